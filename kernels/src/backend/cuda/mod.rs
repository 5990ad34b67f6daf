//! The CUDA backend: the CPU backend's batched Llama forward pass, as
//! kernels on a device, over KV pages in device memory.
//!
//! A step, in order:
//!
//! 1. **Validate** exactly as the CPU backend does ([`super::validate_step`]):
//!    sizes, tokens, positions, and every page the step touches a live lease
//!    of its sequence, the pages it writes its own. Then the pool's page
//!    book checks every lease once more and lends the step its page ids
//!    ([`crate::kv::Pool::step_view`]); the view borrows the pool until the
//!    step's last kernel has finished, so nothing can release or re-lease a
//!    page under a running kernel.
//! 2. **Pack** the step's inputs into one host buffer: token ids, positions,
//!    each token's sequence, the page tables (only the checked page ids:
//!    the device never sees a table the book has not checked), the attention
//!    work items and the logit rows; copy it to the device in one write.
//! 3. **Launch**: embedding rows; per layer RMSNorm and quantization, Q/K/V
//!    in one matmul, RoPE and the KV store into pages, paged attention (and
//!    the merge of split decode attention), Wo added into the residual
//!    stream, RMSNorm and quantization, gate and up with SwiGLU in one
//!    matmul, down added into the residual stream; then the final norm of
//!    the rows that want logits, the output head, and each row's token (`pick`).
//!    Some of these are folded into others ([`Fusions`]): in a step of at
//!    most 8 tokens each product makes its own activations (the norm and
//!    quantization in its blocks), the Q/K/V product turns Q and K and
//!    stores K and V into the pages itself, and the last of a decode
//!    token's attention splits to finish folds them. A SmolLM2 decode step
//!    is then 5 launches a layer and 3 more.
//! 4. **Read** the logits back: the full rows, and a greedy or drawn row's
//!    token alone ([`SeqStep::pick`]: its argmax, or its draw made by the
//!    `pick` kernel, `kernels/cuda/sample.cu`).
//!
//! A step of decode tokens only (each sequence one token) of up to
//! `step_seqs_max` sequences can run as a captured CUDA graph: the launches
//! of step 3 for a bucket of sequences (1, 2, 4, ... rounded up), padded
//! with tokens of no sequence that store nothing. Everything that changes
//! from step to step is in the packed buffer, so one capture per bucket
//! replays for every later step of that size.
//!
//! The arithmetic is the CPU's: activations quantized to the same Q8 blocks,
//! integer dot products per block, f32 elsewhere; results differ from the
//! CPU backend's by the order of f32 sums (measured by the conformance test
//! and `scripts/gpu-check.sh`).

#[doc(hidden)]
pub mod check;
mod dependent;
pub mod device;
pub mod driver;
#[cfg(feature = "emulator")]
pub mod emulator;
pub mod launch;
pub mod nvrtc;
mod pack;
pub mod storage;
mod tensor_cores;
#[cfg(all(test, feature = "emulator"))]
mod tests;

pub use dependent::DependentLaunches;
pub use device::{
    Device, DeviceBuffer, DeviceError, DeviceGraph, Geometry, HostFloats, LaunchTime,
};
pub use driver::{lost, probe, Cuda, CudaDevice, CudaUnavailable, Probe, ProbedDevice};
pub use storage::{device_identity, DeviceStorage};
pub use tensor_cores::{TensorCoresProbe, PROBE_TOLERANCE};

use super::{validate_step, Backend, Logits, SeqStep, StepError, StepLimits};
use crate::kv::{PageLayout, Pool, StepView};
use crate::model::{Activation, Matrix, Model, RopeStyle};
use crate::quant::{ActivationFormat, GgmlType};
use launch::*;
use pack::{Counts, Given, Packer, StepLayout, SCORE_WORDS};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// The most KV positions in one split of a decode token's attention: a
/// token at depth p is split into at least ceil((p + 1) / 256) work items
/// per KV head, merged after; a step of few sequences splits finer, down to
/// a tile a split (see `pack::decode_span`).
pub const SPLIT_POSITIONS: u32 = 256;
/// Most page-locked host memory a backend takes for rows of logits (a row a
/// sequence of its largest step, fewer where they are more): memory the
/// system can no longer page, outside the memory budget, so bounded. 64 MiB
/// holds 341 rows of SmolLM2's vocabulary, 110 of Qwen's.
pub const PINNED_BYTES_MAX: u64 = 64 << 20;
/// Bytes per step-buffer word.
const WORD: u64 = 4;

/// Sizing of a CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Most tokens in one step.
    pub step_tokens_max: usize,
    /// Most sequences in one step.
    pub step_seqs_max: usize,
    /// Whether decode-only steps run as captured graphs.
    pub graphs: bool,
    /// Whether large steps' quantized products may run on the tensor cores:
    /// where the device has them and the start-up probe finds them agreeing
    /// with the warps' ([`CudaBackend::tensor_cores_probe`]). Off, nothing
    /// is probed and [`CudaBackend::set_tensor_cores`] cannot turn them on.
    pub tensor_cores: bool,
    /// Whether a step's launches after its first are dependent launches
    /// (each may begin before the kernel before it ends: `dependent.rs`),
    /// where the device has them and the start-up probe finds them sound
    /// ([`CudaBackend::dependent_launches`]). Off, nothing is probed and
    /// [`CudaBackend::set_dependent_launches`] cannot turn them on.
    pub dependent_launches: bool,
}

impl CudaOptions {
    /// The step sizes these options give.
    fn limits(&self) -> StepLimits {
        StepLimits {
            step_tokens_max: self.step_tokens_max.max(1),
            step_seqs_max: self.step_seqs_max.max(1),
        }
    }
}

/// Why a CUDA backend could not be built for a model.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The device failed (allocation, copy).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The model needs something these kernels do not run.
    #[error("the CUDA backend does not run this model: {0}")]
    Unsupported(String),
}

/// The weight types `kernels/cuda/quant.cu` runs (their GGUF numbers are its
/// `TYPE_*` in `args.cuh`): every type the CPU backend runs; a model with any
/// other is refused before anything is uploaded.
const DEVICE_TYPES: [GgmlType; 11] = GgmlType::ALL;

/// A weight matrix on the device.
struct DeviceMatrix {
    buffer: DeviceBuffer,
    /// Added to each product (qwen2's Q, K and V).
    bias: Option<DeviceBuffer>,
    ty: GgmlType,
    rows: u32,
    row_bytes: u32,
}

impl DeviceMatrix {
    fn upload(
        device: &Arc<dyn Device>,
        model: &Model,
        matrix: &Matrix,
    ) -> Result<Self, DeviceError> {
        Ok(DeviceMatrix {
            buffer: DeviceBuffer::from_bytes(device, model.bytes(matrix))?,
            bias: None,
            ty: matrix.ty(),
            rows: matrix.rows as u32,
            row_bytes: matrix.row_bytes() as u32,
        })
    }

    /// This matrix with `bias` (one value a row) added to its products.
    fn with_bias(
        mut self,
        device: &Arc<dyn Device>,
        bias: Option<&Vec<f32>>,
    ) -> Result<Self, DeviceError> {
        self.bias = bias.map(|b| floats(device, b)).transpose()?;
        Ok(self)
    }

    fn bytes(&self) -> u64 {
        self.buffer.bytes() + self.bias.as_ref().map_or(0, DeviceBuffer::bytes)
    }

    fn format(&self) -> ActivationFormat {
        ActivationFormat::for_weights(self.ty)
    }

    /// This matrix as a matmul segment writing `[tokens][out_stride]` at `out`.
    fn seg(&self, out: u64, out_stride: u32) -> MatSeg {
        MatSeg {
            w: self.buffer.at(0),
            out,
            bias: self.bias.as_ref().map_or(0, |b| b.at(0)),
            cap: 0.0,
            unused: 0,
            ty: self.ty as u32,
            rows: self.rows,
            row_bytes: self.row_bytes,
            out_stride,
        }
    }
}

fn floats(device: &Arc<dyn Device>, values: &[f32]) -> Result<DeviceBuffer, DeviceError> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    DeviceBuffer::from_bytes(device, &bytes)
}

struct DeviceLayer {
    attn_norm: DeviceBuffer,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    /// RMSNorm gains of each Q head and each K head (qwen3, gemma3).
    qk_norm: Option<[DeviceBuffer; 2]>,
    /// RMSNorm gains of attention's and the FFN's outputs (gemma2, gemma3).
    post_norms: Option<[DeviceBuffer; 2]>,
    ffn_norm: DeviceBuffer,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

struct Weights {
    embed: DeviceMatrix,
    output_norm: DeviceBuffer,
    output: DeviceMatrix,
    layers: Vec<DeviceLayer>,
    /// Llama 3's divisors of each RoPE pair's frequency.
    rope_factors: Option<DeviceBuffer>,
}

/// Per-step device buffers, allocated once for the largest step (`wide`:
/// max(d, q_len, ffn)).
struct Scratch {
    /// f32 `[tokens][d]`: the residual stream.
    x: DeviceBuffer,
    /// f32 `[tokens][wide]`: the normalised (or copied) input of a product.
    xn: DeviceBuffer,
    /// f32 `[tokens][q_len]`.
    q: DeviceBuffer,
    /// f32 `[tokens][kv_len]`.
    k: DeviceBuffer,
    /// f32 `[tokens][kv_len]`.
    v: DeviceBuffer,
    /// f32 `[tokens][q_len]`: attention's output.
    attn: DeviceBuffer,
    /// f32 `[tokens][ffn]`: act(gate) * up.
    ffn: DeviceBuffer,
    /// f32 `[tokens][d]`: a block's output before its post-norm (gemma2, gemma3).
    delta: Option<DeviceBuffer>,
    /// i8 `[tokens][wide]`: quantized activations.
    qs: DeviceBuffer,
    /// f32 `[tokens][wide / 32]`: their scales.
    qd: DeviceBuffer,
    /// i32 `[tokens][wide / 16]`: sums of 16 quants.
    sums: DeviceBuffer,
    /// f32 `[rows][vocab]`: the gathered rows' logits, full rows first.
    logits: DeviceBuffer,
    /// u32 `[rows]`: each row's token (`pick`: its draw's, or its argmax).
    picks: DeviceBuffer,
    /// u32 `[rows][SCORE_WORDS]`: a picked row's log probabilities, where
    /// its step asked for them.
    scores: DeviceBuffer,
}

/// The device side of the step buffer and its layout, made at the first step.
struct StepBuffer {
    layout: StepLayout,
    buffer: DeviceBuffer,
    partials: DeviceBuffer,
    /// f32 `[adjusts_max][4]`, a word of the adjustments' rooms each: each
    /// adjusted logit as it was, where its row asks for log probabilities
    /// (of the row before its adjustments).
    originals: DeviceBuffer,
}

/// The CUDA backend.
pub struct CudaBackend {
    /// Captured decode steps by bucket size. First field: dropped before the
    /// buffers their launches use.
    graphs: HashMap<u32, Box<dyn DeviceGraph>>,
    step: Option<StepBuffer>,
    scratch: Scratch,
    weights: Weights,
    device: Arc<dyn Device>,
    model: Arc<Model>,
    options: CudaOptions,
    /// Query rows per attention item (a multiple of the KV group).
    attention_rows: u32,
    /// Host staging for the packed step buffer, words: zero but where the
    /// last step was packed (`staged`).
    staging: Vec<u32>,
    /// The words of `staging` the last step used ([`Packer::used`]): the
    /// only ones copied to the device, and zeroed again before the next.
    staged: Vec<Range<usize>>,
    /// The words of the device's step buffer that may hold an earlier
    /// step's values (every other word is zero): a step copies these with
    /// its own, zeros where it wrote nothing, so that past a step the
    /// device holds no page id, token or position but that step's.
    on_device: Vec<Range<usize>>,
    /// Host copy of the last step's full rows of logits, where they are
    /// more than `pinned` holds (a prompt's log probabilities).
    logits: Vec<f32>,
    /// Page-locked host memory for a row of logits a sequence (a decode
    /// step's sampled rows), at most [`PINNED_BYTES_MAX`]: read at the
    /// bus's speed, where a read into `logits` is staged through the
    /// driver's own buffer. `None` where the driver would not lock it.
    pinned: Option<HostFloats>,
    /// The last step's rows given as their token, `(row, id)`.
    picks: Vec<(u32, u32)>,
    /// Host copy of the last step's picked rows' tokens.
    pick_ids: Vec<u32>,
    /// The last step's picked rows' log probabilities, `(row, them)`, where
    /// asked, and the host copy of their words.
    scored: Vec<(u32, crate::backend::Logprobs)>,
    score_words: Vec<u32>,
    /// How each sequence of the step being run has its rows given: its
    /// scored prompt rows as their scores, its sampled row picked on the
    /// device (as its [`SeqStep::pick`] asks, where its adjustments fit:
    /// [`Packer::logits`]).
    given: Vec<Given>,
    /// Launches folded into others ([`CudaBackend::set_fusions`]).
    fusions: Fusions,
    /// Decode tokens' attention by warps where the kernel can
    /// ([`CudaBackend::set_decode_attention_by_warps`]).
    decode_by_warps: bool,
    /// Products of steps past [`MATMUL_TOKENS`] tokens on the tensor cores
    /// where the device has them ([`CudaBackend::set_tensor_cores`]) and
    /// the start-up probe found them agreeing with the warps.
    tensor_cores: bool,
    /// What the start-up probe found of them (`tensor_cores.rs`).
    tensor_cores_probe: TensorCoresProbe,
    /// A step's launches after its first are dependent launches
    /// ([`CudaBackend::set_dependent_launches`]) where the start-up probe
    /// agreed (`dependent.rs`).
    dependent: bool,
    /// What that probe found.
    dependent_probe: DependentLaunches,
    /// Inside a chain of launches ([`CudaBackend::chained`]): whether one
    /// was made yet (the next may then be a dependent). `None` outside one:
    /// every launch is made as it always was.
    chain: std::cell::Cell<Option<bool>>,
    /// Queries of a prefill chunk's attention item, a block each
    /// ([`CudaBackend::set_prefill_item_queries`]).
    prefill_queries: u32,
}

/// Launches a step folds into others. Each gives the bits of the separate
/// launches it replaces (tested on the emulator); turning one off, as the
/// GPU check does to measure what it saves, brings its launches back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fusions {
    /// In a step of at most [`MATMUL_TOKENS`] tokens each product makes its
    /// own activations (RMSNorm and quantization in its blocks): no norm
    /// launch before it (see `CudaBackend::fused_shared`).
    pub norms: bool,
    /// The Q/K/V product turns Q and K and stores K and V into the pages
    /// ([`mode::ROPE_KV`]): no `rope_kv` launch after it. For models
    /// without per-head Q/K norms (they come between the product and RoPE)
    /// whose Q, K and V take one activation format (one launch).
    pub rope: bool,
    /// The last of a decode token's attention splits to finish folds their
    /// partials: no `attention_merge` launch after attention.
    pub merge: bool,
}

impl Fusions {
    /// Every launch on its own.
    pub const NONE: Fusions = Fusions {
        norms: false,
        rope: false,
        merge: false,
    };
}

impl Default for Fusions {
    /// Every fusion: as the server runs.
    fn default() -> Fusions {
        Fusions {
            norms: true,
            rope: true,
            merge: true,
        }
    }
}

/// The largest number of query rows (a multiple of `group`, at most
/// [`ATTENTION_ROWS_MAX`]) whose attention block fits `shared_max` bytes.
pub fn attention_rows(head_dim: u32, group: u32, shared_max: u32) -> Option<u32> {
    let mut rows = (ATTENTION_ROWS_MAX / group) * group;
    while rows >= group && rows > 0 {
        if attention_shared_bytes(head_dim, rows, ATTENTION_TILE) <= shared_max {
            return Some(rows);
        }
        rows -= group;
    }
    None
}

/// Whether these kernels run `model`, without a device: every family of the
/// blueprint (its options are the kernels' too), so what is left to check is
/// every matrix of a type in `DEVICE_TYPES`, widths of whole 32-blocks and
/// head widths of whole 16-byte rows.
/// `Err` says what they lack (a placement of `auto` then chooses the CPU;
/// `cuda` refuses).
pub fn runs(model: &Model) -> Result<(), String> {
    let c = &model.config;
    for matrix in model.matrices() {
        if !DEVICE_TYPES.contains(&matrix.ty()) {
            return Err(format!(
                "{} is {}, a type these kernels do not run (they run {})",
                matrix.info.name,
                matrix.ty().name(),
                DEVICE_TYPES.map(GgmlType::name).join(", ")
            ));
        }
    }
    let widths = [c.embedding_len, c.q_len(), c.ffn_len];
    if widths.iter().any(|w| !w.is_multiple_of(32)) {
        return Err(format!(
            "widths (d, q_len, ffn: {widths:?}) that are not whole 32-blocks"
        ));
    }
    // Attention reads a head's K and V 16 bytes at a time.
    if !c.head_dim.is_multiple_of(8) {
        return Err(format!(
            "a head width ({}) that is not a multiple of 8",
            c.head_dim
        ));
    }
    Ok(())
}

impl CudaBackend {
    /// A backend for `model` on `device`, its weights uploaded and its
    /// scratch allocated now.
    pub fn new(
        model: Arc<Model>,
        device: Arc<dyn Device>,
        options: CudaOptions,
    ) -> Result<CudaBackend, CudaError> {
        // Checked first, before the device is asked anything.
        runs(&model).map_err(CudaError::Unsupported)?;
        let c = &model.config;
        let unsupported = |what: String| Err(CudaError::Unsupported(what));
        let group = c.kv_group() as u32;
        let Some(attention_rows) =
            attention_rows(c.head_dim as u32, group, device.shared_bytes_max())
        else {
            return unsupported(format!(
                "attention with head_dim {} and {} query heads per KV head needs more shared memory \
                 than the device's {} bytes",
                c.head_dim, group, device.shared_bytes_max()
            ));
        };
        let weights = Weights {
            embed: DeviceMatrix::upload(&device, &model, &model.token_embd)?,
            output_norm: floats(&device, &model.output_norm)?,
            output: DeviceMatrix::upload(&device, &model, &model.output)?,
            layers: model
                .layers
                .iter()
                .map(|w| {
                    Ok(DeviceLayer {
                        attn_norm: floats(&device, &w.attn_norm)?,
                        wq: DeviceMatrix::upload(&device, &model, &w.wq)?
                            .with_bias(&device, w.qkv_bias.as_ref().map(|b| &b[0]))?,
                        wk: DeviceMatrix::upload(&device, &model, &w.wk)?
                            .with_bias(&device, w.qkv_bias.as_ref().map(|b| &b[1]))?,
                        wv: DeviceMatrix::upload(&device, &model, &w.wv)?
                            .with_bias(&device, w.qkv_bias.as_ref().map(|b| &b[2]))?,
                        wo: DeviceMatrix::upload(&device, &model, &w.wo)?,
                        qk_norm: match &w.qk_norm {
                            Some([q, k]) => Some([floats(&device, q)?, floats(&device, k)?]),
                            None => None,
                        },
                        post_norms: match (&w.attn_post_norm, &w.ffn_post_norm) {
                            (Some(a), Some(f)) => Some([floats(&device, a)?, floats(&device, f)?]),
                            _ => None,
                        },
                        ffn_norm: floats(&device, &w.ffn_norm)?,
                        w_gate: DeviceMatrix::upload(&device, &model, &w.w_gate)?,
                        w_up: DeviceMatrix::upload(&device, &model, &w.w_up)?,
                        w_down: DeviceMatrix::upload(&device, &model, &w.w_down)?,
                    })
                })
                .collect::<Result<Vec<_>, DeviceError>>()?,
            rope_factors: c
                .rope_freq_factors
                .as_ref()
                .map(|f| floats(&device, f))
                .transpose()?,
        };
        let (t, s) = (
            options.step_tokens_max.max(1) as u64,
            options.step_seqs_max.max(1) as u64,
        );
        let rows = options.limits().step_logits_max() as u64;
        let (d, q_len, kv, ffn, vocab) = (
            c.embedding_len as u64,
            c.q_len() as u64,
            c.kv_len() as u64,
            c.ffn_len as u64,
            c.vocab_len as u64,
        );
        let wide = d.max(q_len).max(ffn);
        let zeroed = |bytes: u64| DeviceBuffer::zeroed(&device, bytes);
        let scratch = Scratch {
            x: zeroed(4 * t * d)?,
            xn: zeroed(4 * t * wide)?,
            q: zeroed(4 * t * q_len)?,
            k: zeroed(4 * t * kv)?,
            v: zeroed(4 * t * kv)?,
            attn: zeroed(4 * t * q_len)?,
            ffn: zeroed(4 * t * ffn)?,
            delta: match c.post_norms {
                true => Some(zeroed(4 * t * d)?),
                false => None,
            },
            qs: zeroed(t * wide)?,
            qd: zeroed(4 * t * wide / 32)?,
            sums: zeroed(4 * t * wide / 16)?,
            logits: zeroed(4 * rows * vocab)?,
            picks: zeroed(4 * rows)?,
            scores: zeroed(4 * rows * SCORE_WORDS as u64)?,
        };
        // Without it every read goes through `logits`, as fast as a
        // pageable read goes: not worth refusing the model for.
        let pinned_rows = s.min(PINNED_BYTES_MAX / (4 * vocab)).max(1);
        let pinned = HostFloats::zeroed(&device, (pinned_rows * vocab) as usize).ok();
        let tensor_cores = device.tensor_cores() && options.tensor_cores;
        let mut backend = CudaBackend {
            graphs: HashMap::new(),
            step: None,
            scratch,
            weights,
            device,
            model,
            options: CudaOptions {
                step_tokens_max: t as usize,
                step_seqs_max: s as usize,
                ..options
            },
            attention_rows,
            staging: Vec::new(),
            staged: Vec::new(),
            on_device: Vec::new(),
            logits: Vec::new(),
            pinned,
            picks: Vec::new(),
            pick_ids: Vec::new(),
            scored: Vec::new(),
            score_words: Vec::new(),
            given: Vec::new(),
            fusions: Fusions::default(),
            decode_by_warps: true,
            tensor_cores,
            tensor_cores_probe: TensorCoresProbe::Unused,
            dependent: false,
            dependent_probe: DependentLaunches::Off,
            chain: std::cell::Cell::new(None),
            prefill_queries: attention_rows / group,
        };
        backend.tensor_cores_probe = backend.probe_tensor_cores()?;
        backend.dependent_probe = backend.probe_dependent_launches()?;
        Ok(backend)
    }

    /// The model this backend runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The device it runs on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Device memory the backend's weights and scratch take (the pool's is the pool's).
    pub fn device_bytes(&self) -> u64 {
        let w = &self.weights;
        let matrices = |l: &DeviceLayer| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .map(|m| m.bytes())
                .sum::<u64>()
                + l.attn_norm.bytes()
                + l.ffn_norm.bytes()
                + l.qk_norm
                    .iter()
                    .chain(&l.post_norms)
                    .flatten()
                    .map(DeviceBuffer::bytes)
                    .sum::<u64>()
        };
        let s = &self.scratch;
        w.embed.bytes()
            + w.output.bytes()
            + w.output_norm.bytes()
            + w.rope_factors.as_ref().map_or(0, DeviceBuffer::bytes)
            + w.layers.iter().map(matrices).sum::<u64>()
            + [
                &s.x, &s.xn, &s.q, &s.k, &s.v, &s.attn, &s.ffn, &s.qs, &s.qd, &s.sums, &s.logits,
                &s.picks, &s.scores,
            ]
            .iter()
            .map(|b| b.bytes())
            .sum::<u64>()
            + s.delta.as_ref().map_or(0, DeviceBuffer::bytes)
            + self.step.as_ref().map_or(0, |b| {
                b.buffer.bytes() + b.partials.bytes() + b.originals.bytes()
            })
    }

    /// Makes the step buffer for `layout`'s page size (once, or again for another pool).
    fn ensure_step_buffer(&mut self, layout: &PageLayout) -> Result<(), DeviceError> {
        let page_tokens = layout.geometry().page_tokens;
        if self
            .step
            .as_ref()
            .is_some_and(|s| s.layout.page_tokens == page_tokens)
        {
            return Ok(());
        }
        self.graphs.clear();
        let c = &self.model.config;
        let group = c.kv_group() as u32;
        let step_layout = StepLayout::new(
            &self.options,
            &self.model,
            page_tokens,
            self.prefill_queries,
        );
        let partial_floats = step_layout.slots_max * u64::from(group) * (2 + c.head_dim as u64);
        // Staged for another layout: made afresh for this one.
        self.staging.clear();
        self.staged.clear();
        self.on_device.clear();
        self.step = Some(StepBuffer {
            buffer: DeviceBuffer::zeroed(&self.device, step_layout.words * WORD)?,
            partials: DeviceBuffer::zeroed(&self.device, partial_floats.max(1) * 4)?,
            originals: DeviceBuffer::zeroed(&self.device, step_layout.adjusts_max.max(1) * 16)?,
            layout: step_layout,
        });
        Ok(())
    }

    /// The graph bucket of a decode-only step of `seqs` sequences, if it can run as one.
    fn graph_bucket(&self, steps: &[SeqStep<'_>]) -> Option<u32> {
        if !self.options.graphs || steps.iter().any(|s| s.tokens.len() != 1) {
            return None;
        }
        let bucket = (steps.len() as u32).next_power_of_two();
        (bucket as usize <= self.options.step_seqs_max).then_some(bucket)
    }

    /// Packs the step into `staging` (see the module doc, and [`pack`]),
    /// the words it used into `staged`; returns the launch counts. With a
    /// bucket, pads to it.
    fn pack(&mut self, steps: &[SeqStep<'_>], view: &StepView<'_>, bucket: Option<u32>) -> Counts {
        let layout = self.step.as_ref().expect("made before packing").layout;
        let c = &self.model.config;
        let kv_heads = c.kv_heads_count as u32;
        let queries_per_item = self.prefill_queries;
        let page_tokens = layout.page_tokens as usize;
        if self.staging.len() == layout.words as usize {
            for range in self.staged.drain(..) {
                self.staging[range].fill(0);
            }
        } else {
            self.staging.clear();
            self.staging.resize(layout.words as usize, 0);
        }
        debug_assert!(self.staging.iter().all(|&w| w == 0), "staging zeroed");
        let split_seqs = bucket.unwrap_or(steps.len() as u32);
        let mut packer = Packer::new(&mut self.staging, layout, split_seqs);
        self.given.clear();
        for (seq, step) in steps.iter().enumerate() {
            let t0 = packer.counts.tokens;
            for (i, &token) in step.tokens.iter().enumerate() {
                packer.token(token, (step.pos_start + i) as u32, seq as u32);
            }
            // The page ids the view checked, as far as the step reaches.
            let end = step.pos_start + step.tokens.len();
            packer.table(seq as u32, &view.page_ids(seq)[..end.div_ceil(page_tokens)]);
            let given = packer.logits(
                step.logits,
                step.pick,
                step.adjust,
                step.logprobs,
                step.scores,
            );
            self.given.push(given);
            let pos0 = step.pos_start as u32;
            match step.tokens.len() {
                1 => packer.decode_items(seq as u32, t0, pos0, kv_heads),
                _ => packer.prefill_items(seq as u32, t0, pos0, kv_heads, queries_per_item),
            }
        }
        packer.picked_rows();
        let counts = match bucket {
            None => packer.counts,
            Some(bucket) => packer.pad(bucket, kv_heads, c.context_len as u32),
        };
        self.staged = packer.used(&counts, steps.len() as u32);
        counts
    }

    fn launch<A: KernelArgs>(
        &self,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        args: &A,
    ) -> Result<(), DeviceError> {
        if grid == 0 {
            return Ok(());
        }
        let geometry = Geometry {
            grid,
            block,
            shared_bytes,
        };
        // In a chain, after its first launch, a dependent where they are on.
        let dependent = match self.chain.get() {
            Some(after) => {
                self.chain.set(Some(true));
                after && self.dependent
            }
            None => false,
        };
        // SAFETY: every address in `args` is one of this backend's buffers or
        // the pool's values, each sized for the largest step (`new`,
        // `ensure_step_buffer`); indices into them come from the packed
        // step, whose page ids the page book checked and whose counts
        // validation bounded. A dependent follows a launch of the chain.
        unsafe {
            match dependent {
                true => self
                    .device
                    .launch_dependent(A::KERNEL, geometry, args.bytes()),
                false => self.device.launch(A::KERNEL, geometry, args.bytes()),
            }
        }
    }

    /// Runs `launches`, which queue launches and nothing else (a step's
    /// forward pass, whether captured or queued), as one chain: every
    /// launch after the first a dependent of the one before it, where
    /// dependent launches are on.
    fn chained(
        &self,
        launches: impl FnOnce() -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        self.chain.set(Some(false));
        let ran = launches();
        self.chain.set(None);
        ran
    }

    /// Whether a step's launches after its first are dependent launches
    /// (the default where the device has them and the start-up probe
    /// agreed: [`CudaBackend::dependent_launches`]) or each starts once the
    /// one before it has ended. The same bits either way; the GPU check
    /// times both.
    pub fn set_dependent_launches(&mut self, on: bool) {
        let on = on && self.dependent_probe == DependentLaunches::Agreed;
        if self.dependent != on {
            self.dependent = on;
            self.graphs.clear();
        }
    }

    /// `out[r] = rmsnorm(x[src]) * gain` (or `x[src]` without a gain) and its
    /// quantization for weights taking `format`.
    fn norm(&self, input: &Input<'_>, rows: u32, width: u32) -> Result<(), DeviceError> {
        let s = &self.scratch;
        let block_len = block_len(input.format);
        let args = NormArgs {
            x: input.x,
            gather: input.gather,
            gain: input.gain.map_or(0, |g| g.at(0)),
            out: s.xn.at(0),
            qs: if block_len == 0 { 0 } else { s.qs.at(0) },
            d: s.qd.at(0),
            sums: s.sums.at(0),
            width,
            block_len: block_len.max(32),
            eps: self.model.config.rms_eps,
            accumulate: 0,
        };
        self.launch(rows, NORM_BLOCK, 0, &args)
    }

    /// The products of `segs` (matrices of `input.format`'s weights) with
    /// `input`'s rows: one launch whose blocks normalise and quantize their
    /// own tokens' rows where [`CudaBackend::fused_shared`] allows, else a
    /// norm launch into the scratch and a product launch reading it.
    fn matmul(
        &self,
        segs: &[MatSeg],
        input: &Input<'_>,
        k: u32,
        tokens: u32,
        mode: u32,
    ) -> Result<(), DeviceError> {
        self.matmul_rope(segs, input, k, tokens, mode, RopeKvArgs::default())
    }

    /// [`CudaBackend::matmul`], with `rope` for [`mode::ROPE_KV`].
    fn matmul_rope(
        &self,
        segs: &[MatSeg],
        input: &Input<'_>,
        k: u32,
        tokens: u32,
        mode: u32,
        rope: RopeKvArgs,
    ) -> Result<(), DeviceError> {
        let s = &self.scratch;
        let mut seg = [MatSeg::default(); MATMUL_SEGS_MAX];
        seg[..segs.len()].copy_from_slice(segs);
        let rows: u32 = if mode == mode::SWIGLU || mode == mode::GEGLU {
            segs[0].rows
        } else {
            segs.iter().map(|s| s.rows).sum()
        };
        let fused = self.fused_shared(tokens, k, rows, input.format);
        if fused.is_none() {
            self.norm(input, tokens, k)?;
        }
        let args = MatmulArgs {
            seg,
            x: s.xn.at(0),
            qs: s.qs.at(0),
            d: s.qd.at(0),
            sums: s.sums.at(0),
            norm_x: if fused.is_some() { input.x } else { 0 },
            norm_gather: input.gather,
            norm_gain: input.gain.map_or(0, |g| g.at(0)),
            segs: segs.len() as u32,
            k,
            tokens,
            mode,
            block_len: block_len(input.format),
            eps: self.model.config.rms_eps,
            rope,
        };
        // ROPE_KV has no tensor-core form (the step's Q/K/V product is
        // launched as STORE where the tensor cores take it); past
        // MATMUL_TOKENS the norm launch above made the activations.
        if mode != mode::ROPE_KV && self.on_tensor_cores(tokens, input.format) {
            debug_assert!(fused.is_none());
            let geometry = matmul_mma_blocks(rows, tokens);
            return self.launch(geometry, MATMUL_WARPS * 32, 0, &MatmulMmaArgs(args));
        }
        let geometry = matmul_blocks(rows, tokens, mode);
        self.launch(geometry, MATMUL_WARPS * 32, fused.unwrap_or(0), &args)
    }

    /// The dynamic shared memory of a product whose blocks make their own
    /// tokens' Q8 activations (`MatmulArgs::norm_x`), or `None` where a norm
    /// launch makes them: for float weights (they take f32 activations);
    /// past one block's [`MATMUL_TOKENS`] tokens, where every row block would
    /// read and normalise the same rows again (a block's rows, tokens x k
    /// floats from L2, are 13 times its weights' bytes at SmolLM2's width: a
    /// separate launch costs less once the step is not launch-bound); past
    /// [`FUSED_ROWS_MAX`] rows (an output head), whose many blocks would
    /// each normalise the same rows; past the shared memory a block has
    /// without opting in; and when turned off
    /// ([`CudaBackend::set_fusions`]).
    fn fused_shared(
        &self,
        tokens: u32,
        k: u32,
        rows: u32,
        format: ActivationFormat,
    ) -> Option<u32> {
        self.fusions
            .norms
            .then(|| fused_shared_bytes(tokens, k, rows, format))
            .flatten()
    }

    /// Whether a decode token's attention is read by warps (a few lanes a
    /// position, no barrier between positions; the default) or by tiles of
    /// positions through shared memory, as a prefill chunk's is. The sums
    /// run in another order, so the bits may differ in their last places;
    /// the GPU check times both.
    pub fn set_decode_attention_by_warps(&mut self, by_warps: bool) {
        if self.decode_by_warps != by_warps {
            self.decode_by_warps = by_warps;
            self.graphs.clear();
        }
    }

    /// Whether the quantized products of a step of more than
    /// [`MATMUL_TOKENS`] tokens (a large batch, a prefill chunk) run on the
    /// tensor cores (`matmul_mma`: the default where the device has them)
    /// or as smaller steps' do (a warp a row, `matmul`). The sums run in
    /// another order, so the bits may differ in their last places; the GPU
    /// check times both. Such a step's Q/K/V product then stores Q, K and V
    /// and a `rope_kv` launch turns and stores them (`matmul_mma` has no
    /// `ROPE_KV` mode). Off where the device has no tensor cores for it,
    /// where the start-up probe refused them
    /// ([`CudaBackend::tensor_cores_probe`]), and where the options turned
    /// them off ([`CudaOptions::tensor_cores`]).
    pub fn set_tensor_cores(&mut self, on: bool) {
        let barred = matches!(
            self.tensor_cores_probe,
            TensorCoresProbe::Refused { .. } | TensorCoresProbe::Off
        );
        let on = on && self.device.tensor_cores() && !barred;
        if self.tensor_cores != on {
            self.tensor_cores = on;
            self.graphs.clear();
        }
    }

    /// How many queries of a prefill chunk one attention block takes (their
    /// rows times the group's query heads; by default as many as its shared
    /// memory holds, each tile of K and V read once for them all), at least
    /// one. Fewer make more blocks of the same work, each reading the tiles
    /// again: a chunk of 512 over a 4,096-token prompt is 156 blocks of 10
    /// queries on SmolLM2, about one an SM. Every row's sums run in the
    /// same order either way (the same bits) but in an item of one query,
    /// read by warps as a decode token's is (its last places may differ;
    /// a chunk's last item may be one query at any size). The GPU check
    /// times both.
    pub fn set_prefill_item_queries(&mut self, queries: u32) {
        let most = self.attention_rows / self.model.config.kv_group() as u32;
        let queries = queries.clamp(1, most);
        if self.prefill_queries != queries {
            self.prefill_queries = queries;
            // The step buffer holds as many items as its chunks make.
            self.step = None;
            self.graphs.clear();
        }
    }

    /// Whether a product of `tokens` tokens with weights taking `format`
    /// runs on the tensor cores.
    fn on_tensor_cores(&self, tokens: u32, format: ActivationFormat) -> bool {
        self.tensor_cores && tokens > MATMUL_TOKENS && block_len(format) != 0
    }

    /// Which launches are folded into others ([`Fusions`]; all of them
    /// unless turned off). Either way the same bits.
    pub fn set_fusions(&mut self, fusions: Fusions) {
        if self.fusions != fusions {
            self.fusions = fusions;
            // A captured graph holds the launches of the other way.
            self.graphs.clear();
        }
    }

    /// Products of one input with several matrices: one launch per
    /// activation format among them (see [`CudaBackend::matmul`]).
    fn products(
        &self,
        input: u64,
        gain: Option<&DeviceBuffer>,
        matrices: &[(&DeviceMatrix, u64, u32)],
        k: u32,
        tokens: u32,
        mode: u32,
    ) -> Result<(), DeviceError> {
        let mut done = [false; MATMUL_SEGS_MAX];
        for first in 0..matrices.len() {
            if done[first] {
                continue;
            }
            let format = matrices[first].0.format();
            let mut segs = Vec::with_capacity(MATMUL_SEGS_MAX);
            for (i, (matrix, out, stride)) in matrices.iter().enumerate() {
                if !done[i] && matrix.format() == format {
                    done[i] = true;
                    segs.push(matrix.seg(*out, *stride));
                }
            }
            let input = Input {
                x: input,
                gather: 0,
                gain,
                format,
            };
            self.matmul(&segs, &input, k, tokens, mode)?;
        }
        Ok(())
    }

    /// Every launch of a step (step 3 of the module doc), for `counts`.
    fn forward(&self, counts: Counts, kv_at: u64, layout: &PageLayout) -> Result<(), DeviceError> {
        let c = &self.model.config;
        let s = &self.scratch;
        let step = self.step.as_ref().expect("made before the forward pass");
        let word = |at: u64| step.buffer.at(at * WORD);
        let sl = &step.layout;
        let (d, q_len, kv, ffn) = (
            c.embedding_len as u32,
            c.q_len() as u32,
            c.kv_len() as u32,
            c.ffn_len as u32,
        );
        let t = counts.tokens;
        let geometry = layout.geometry();
        let kv_f16 = u32::from(geometry.kv_type == crate::kv::KvType::F16);
        let w = &self.weights;
        self.launch(
            t,
            ROW_BLOCK,
            0,
            &EmbedArgs {
                table: w.embed.buffer.at(0),
                tokens: word(sl.tokens),
                out: s.x.at(0),
                ty: w.embed.ty as u32,
                width: d,
                row_bytes: w.embed.row_bytes,
                rows: w.embed.rows,
                scale: c.embedding_scale,
                unused: 0,
            },
        )?;
        for (layer, lw) in w.layers.iter().enumerate() {
            // A local layer (a sliding window) has its own RoPE base and scale.
            let local = c.sliding_window.as_ref().filter(|w| w.local[layer]);
            let window = local.map(|w| w.window);
            let (rope_base, rope_scale) = match local {
                Some(w) => (w.rope_base, w.rope_freq_scale),
                None => (c.rope_base, c.rope_freq_scale),
            };
            let rope = RopeKvArgs {
                q: s.q.at(0),
                k: s.k.at(0),
                v: s.v.at(0),
                kv: kv_at,
                token_seq: word(sl.token_seq),
                positions: word(sl.positions),
                seq_pages: word(sl.seq_pages),
                pages: word(sl.pages),
                freq_factors: w.rope_factors.as_ref().map_or(0, |f| f.at(0)),
                heads: c.heads_count as u32,
                kv_heads: c.kv_heads_count as u32,
                head_dim: c.head_dim as u32,
                rope_dim: c.rope_dim as u32,
                layer: layer as u32,
                pages_count: geometry.pages_count,
                page_tokens: geometry.page_tokens,
                kv_f16,
                rope_base,
                rope_scale,
                halves: u32::from(c.rope_style == RopeStyle::Halves),
                unused: 0,
            };
            let qkv = [
                (&lw.wq, s.q.at(0), q_len),
                (&lw.wk, s.k.at(0), kv),
                (&lw.wv, s.v.at(0), kv),
            ];
            let format = lw.wq.format();
            let one_launch = qkv.iter().all(|(m, ..)| m.format() == format);
            let rope_in_product = !self.on_tensor_cores(t, format);
            if self.fusions.rope && lw.qk_norm.is_none() && one_launch && rope_in_product {
                let input = Input {
                    x: s.x.at(0),
                    gather: 0,
                    gain: Some(&lw.attn_norm),
                    format,
                };
                let segs = qkv.map(|(m, out, stride)| m.seg(out, stride));
                self.matmul_rope(&segs, &input, d, t, mode::ROPE_KV, rope)?;
            } else {
                self.products(s.x.at(0), Some(&lw.attn_norm), &qkv, d, t, mode::STORE)?;
                if let Some([gq, gk]) = &lw.qk_norm {
                    // Each head of Q and of K normalised in place, as its own row.
                    let head_dim = c.head_dim as u32;
                    for (x, heads, gain) in [
                        (&s.q, c.heads_count as u32, gq),
                        (&s.k, c.kv_heads_count as u32, gk),
                    ] {
                        let args = NormArgs {
                            x: x.at(0),
                            gather: 0,
                            gain: gain.at(0),
                            out: x.at(0),
                            qs: 0,
                            d: 0,
                            sums: 0,
                            width: head_dim,
                            block_len: 32,
                            eps: c.rms_eps,
                            accumulate: 0,
                        };
                        self.launch(t * heads, NORM_BLOCK, 0, &args)?;
                    }
                }
                self.launch(t, ROW_BLOCK, 0, &rope)?;
            }
            // Shared memory for the step's largest item, not the largest any
            // step may have (a prefill chunk's `attention_rows`).
            let rows_max = counts.item_queries_max.max(1) * c.kv_group() as u32;
            debug_assert!(rows_max <= self.attention_rows);
            let fold = self.fusions.merge;
            self.launch(
                counts.items,
                ATTENTION_BLOCK,
                attention_shared_bytes(c.head_dim as u32, rows_max, ATTENTION_TILE),
                &AttentionArgs {
                    q: s.q.at(0),
                    kv: kv_at,
                    items: word(sl.items),
                    seq_pages: word(sl.seq_pages),
                    pages: word(sl.pages),
                    out: s.attn.at(0),
                    partials: step.partials.at(0),
                    merges: if fold { word(sl.merges) } else { 0 },
                    counters: if fold { word(sl.counters) } else { 0 },
                    heads: c.heads_count as u32,
                    kv_heads: c.kv_heads_count as u32,
                    head_dim: c.head_dim as u32,
                    layer: layer as u32,
                    pages_count: geometry.pages_count,
                    page_tokens: geometry.page_tokens,
                    kv_f16,
                    rows_max,
                    tile: ATTENTION_TILE,
                    scale: c.attention_scale,
                    window: window.unwrap_or(0) as u32,
                    softcap: c.attention_softcap.unwrap_or(0.0),
                    by_warps: u32::from(self.decode_by_warps),
                    unused: 0,
                },
            )?;
            self.launch(
                if fold { 0 } else { counts.merges },
                ATTENTION_BLOCK,
                0,
                &MergeArgs {
                    partials: step.partials.at(0),
                    merges: word(sl.merges),
                    out: s.attn.at(0),
                    heads: c.heads_count as u32,
                    kv_heads: c.kv_heads_count as u32,
                    head_dim: c.head_dim as u32,
                    unused: 0,
                },
            )?;
            let post_norms = lw.post_norms.as_ref();
            self.block_output(&lw.wo, s.attn.at(0), q_len, t, post_norms.map(|p| &p[0]))?;
            let (fused, gating) = match c.activation {
                Activation::Silu => (mode::SWIGLU, mode::SILU_MUL),
                Activation::GeluTanh => (mode::GEGLU, mode::GELU_MUL),
            };
            let ffn_norm = Some(&lw.ffn_norm);
            if lw.w_gate.format() == lw.w_up.format() {
                let pair = [(&lw.w_gate, s.ffn.at(0), ffn), (&lw.w_up, 0, ffn)];
                self.products(s.x.at(0), ffn_norm, &pair, d, t, fused)?;
            } else {
                // Two quantizations: the gate stored, then gated by up.
                let (gate, up) = ((&lw.w_gate, s.ffn.at(0), ffn), (&lw.w_up, s.ffn.at(0), ffn));
                self.products(s.x.at(0), ffn_norm, &[gate], d, t, mode::STORE)?;
                self.products(s.x.at(0), ffn_norm, &[up], d, t, gating)?;
            }
            self.block_output(&lw.w_down, s.ffn.at(0), ffn, t, post_norms.map(|p| &p[1]))?;
        }
        let vocab = c.vocab_len as u32;
        let mut head = w.output.seg(s.logits.at(0), vocab);
        head.cap = c.final_softcap.unwrap_or(0.0);
        let input = Input {
            x: s.x.at(0),
            gather: word(sl.gather),
            gain: Some(&w.output_norm),
            format: w.output.format(),
        };
        self.matmul(&[head], &input, d, counts.wanted, mode::STORE)?;
        // Every row's token, whichever the host reads (a graph's rows are its
        // bucket's; the picked ones follow the full ones, a drawn one with
        // its draw in the step buffer).
        let args = PickArgs {
            logits: s.logits.at(0),
            out: s.picks.at(0),
            draws: word(sl.draws),
            adjusts: word(sl.adjusts),
            scores: s.scores.at(0),
            originals: step.originals.at(0),
            vocab,
            unused: 0,
        };
        self.launch(counts.wanted, PICK_BLOCK, 0, &args)
    }

    /// A block's output matrix (attention's `wo`, the FFN's `w_down`) on
    /// `input` (`k` wide), into the residual stream: added to it, or where the
    /// model has post-norms, stored, then normalised with `post_norm` and
    /// added by one more launch.
    fn block_output(
        &self,
        matrix: &DeviceMatrix,
        input: u64,
        k: u32,
        tokens: u32,
        post_norm: Option<&DeviceBuffer>,
    ) -> Result<(), DeviceError> {
        let s = &self.scratch;
        let d = self.model.config.embedding_len as u32;
        let (Some(gain), Some(delta)) = (post_norm, &s.delta) else {
            return self.products(input, None, &[(matrix, s.x.at(0), d)], k, tokens, mode::ADD);
        };
        self.products(
            input,
            None,
            &[(matrix, delta.at(0), d)],
            k,
            tokens,
            mode::STORE,
        )?;
        let args = NormArgs {
            x: delta.at(0),
            gather: 0,
            gain: gain.at(0),
            out: s.x.at(0),
            qs: 0,
            d: 0,
            sums: 0,
            width: d,
            block_len: 32,
            eps: self.model.config.rms_eps,
            accumulate: 1,
        };
        self.launch(tokens, NORM_BLOCK, 0, &args)
    }

    fn device_error(error: DeviceError) -> StepError {
        match error {
            DeviceError::Lost { .. } => StepError::DeviceLost(error.to_string()),
            _ => StepError::Device(error.to_string()),
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        "cuda".to_string()
    }

    fn modes(&self) -> Option<String> {
        let graphs = if self.options.graphs { "on" } else { "off" };
        let cores = match self.tensor_cores_probe {
            TensorCoresProbe::Agreed { .. } if self.tensor_cores => "on",
            TensorCoresProbe::Agreed { .. } | TensorCoresProbe::Off => "off",
            TensorCoresProbe::Refused { .. } => "refused by the start-up probe",
            TensorCoresProbe::Unused => "not used",
        };
        let dependent = match self.dependent_probe {
            DependentLaunches::Agreed if self.dependent => "on",
            DependentLaunches::Agreed | DependentLaunches::Off => "off",
            DependentLaunches::Refused { .. } => "refused by the start-up probe",
            DependentLaunches::Unsupported => "not supported",
        };
        Some(format!(
            "graphs {graphs}, tensor cores {cores}, dependent launches {dependent}"
        ))
    }

    fn step_tokens_max(&self) -> usize {
        self.options.step_tokens_max
    }

    fn step_logits_max(&self) -> usize {
        self.options.limits().step_logits_max()
    }

    fn step(&mut self, steps: &[SeqStep<'_>], pool: &mut Pool) -> Result<Logits<'_>, StepError> {
        let identity = device_identity(&self.device);
        let values = match pool.device_values() {
            Some(values) if values.device == identity => values,
            _ => return Err(StepError::DeviceStorage),
        };
        let layout = *pool.layout();
        let page_tokens = layout.geometry().page_tokens as usize;
        validate_step(
            &self.model.config,
            &self.options.limits(),
            steps,
            page_tokens,
            pool,
        )?;
        self.ensure_step_buffer(&layout)
            .map_err(Self::device_error)?;
        // Every lease checked once more, for the whole step: the view holds
        // the pool until the logits are read (the kernels have finished).
        let tables: Vec<&crate::kv::PageTable> = steps.iter().map(|s| s.pages).collect();
        let view = pool
            .step_view(&tables)
            .expect("validated: every lease of the step is live");
        let bucket = self.graph_bucket(steps);
        let counts = self.pack(steps, &view, bucket);
        let step = self.step.as_ref().expect("made above");
        // This step's words, and zeros over what earlier steps left: until
        // every copy is made, any of them may hold either.
        let copies = pack::joined(self.on_device.iter().chain(&self.staged).cloned());
        self.on_device.clone_from(&copies);
        for range in &copies {
            step.buffer
                .write(
                    range.start as u64 * WORD,
                    le_bytes(&self.staging[range.clone()]),
                )
                .map_err(Self::device_error)?;
        }
        self.on_device.clone_from(&self.staged);
        match bucket {
            Some(bucket) => {
                if !self.graphs.contains_key(&bucket) {
                    let this = &*self;
                    let graph = this
                        .device
                        .capture(&mut || this.chained(|| this.forward(counts, values.at, &layout)))
                        .map_err(Self::device_error)?;
                    self.graphs.insert(bucket, graph);
                }
                self.graphs[&bucket].replay().map_err(Self::device_error)?;
            }
            None => self
                .chained(|| self.forward(counts, values.at, &layout))
                .map_err(Self::device_error)?,
        }
        // The full rows are the logits' first (see `Packer::logits`), read
        // straight into the host's floats; a picked row is its token alone.
        let vocab = self.model.config.vocab_len;
        let wanted: usize = steps.iter().map(|s| s.logits).sum();
        let picked: usize = self.given.iter().map(Given::on_device).sum();
        let full = wanted - picked;
        // Each read waits for the step's kernels: at least one is made
        // before the view lets the pool go.
        let floats = full * vocab;
        let into_pinned = self.pinned.as_ref().is_some_and(|p| floats <= p.len());
        let rows = match &mut self.pinned {
            Some(pinned) if into_pinned => &mut pinned.as_mut_slice()[..floats],
            _ => {
                self.logits.resize(floats, 0.0);
                &mut self.logits[..]
            }
        };
        if full > 0 || picked == 0 {
            self.scratch
                .logits
                .read(0, le_bytes_mut(rows))
                .map_err(Self::device_error)?;
        }
        self.pick_ids.resize(picked, 0);
        if picked > 0 {
            self.scratch
                .picks
                .read(4 * full as u64, le_bytes_mut(&mut self.pick_ids))
                .map_err(Self::device_error)?;
        }
        // Picked rows' log probabilities, where any step asked (or scored
        // its prompt): the words of every picked row (168 bytes each).
        let scores = (steps.iter().zip(&self.given))
            .any(|(s, g)| g.scored > 0 || (g.picked && s.logprobs.is_some()));
        self.score_words
            .resize(if scores { picked * SCORE_WORDS } else { 0 }, 0);
        if scores {
            self.scratch
                .scores
                .read(
                    (4 * SCORE_WORDS * full) as u64,
                    le_bytes_mut(&mut self.score_words),
                )
                .map_err(Self::device_error)?;
        }
        drop(view);
        self.picks.clear();
        self.scored.clear();
        let mut row = 0;
        let mut ids = self.pick_ids.iter().enumerate();
        for (s, given) in steps.iter().zip(&self.given) {
            for _ in 0..given.scored {
                let (k, &id) = ids.next().expect("one id a scored row");
                let words = &self.score_words[k * SCORE_WORDS..(k + 1) * SCORE_WORDS];
                self.picks.push((row as u32, id));
                self.scored.push((row as u32, scores_of(id, words)));
                row += 1;
            }
            row += s.logits - given.scored as usize;
            if given.picked {
                let (k, &id) = ids.next().expect("one id a picked row");
                self.picks.push(((row - 1) as u32, id));
                if s.logprobs.is_some() {
                    let words = &self.score_words[k * SCORE_WORDS..(k + 1) * SCORE_WORDS];
                    self.scored.push(((row - 1) as u32, scores_of(id, words)));
                }
            }
        }
        let values = match &self.pinned {
            Some(pinned) if into_pinned => &pinned.as_slice()[..floats],
            _ => &self.logits[..],
        };
        Ok(Logits {
            values,
            vocab_len: vocab,
            picks: &self.picks,
            scored: &self.scored,
        })
    }
}

/// Token `id`'s log probabilities from the words `pick` wrote for its row
/// (see `SCORE_WORDS`).
fn scores_of(id: u32, words: &[u32]) -> crate::backend::Logprobs {
    let top = (words[1] as usize).min((words.len() - 2) / 2);
    crate::backend::Logprobs {
        token: id,
        logprob: f32::from_bits(words[0]),
        top: (0..top)
            .map(|j| (words[2 + 2 * j], f32::from_bits(words[3 + 2 * j])))
            .collect(),
    }
}

/// Where a product's activations come from: f32 rows (`x`, row
/// `gather[t]` of token t where `gather` is not 0), RMS-normalised with
/// `gain` where there is one, quantized for weights taking `format`.
struct Input<'a> {
    x: u64,
    gather: u64,
    gain: Option<&'a DeviceBuffer>,
    format: ActivationFormat,
}

/// The Q8 block length of `format`'s activations (0: f32, not quantized).
fn block_len(format: ActivationFormat) -> u32 {
    match format {
        ActivationFormat::F32 => 0,
        ActivationFormat::Q8_1 => 32,
        ActivationFormat::Q8_K => 256,
    }
}

/// The dynamic shared memory of a product of `rows` rows whose blocks make
/// their own activations for `tokens` of `k` (`None`: a norm launch makes
/// them; see [`CudaBackend::fused_shared`]).
fn fused_shared_bytes(tokens: u32, k: u32, rows: u32, format: ActivationFormat) -> Option<u32> {
    let block_len = block_len(format);
    if block_len == 0 || tokens > MATMUL_TOKENS || rows > FUSED_ROWS_MAX {
        return None;
    }
    let bytes = u64::from(tokens) * u64::from(k + 4 * k / block_len + 4 * k / 16);
    (bytes <= SHARED_DEFAULT_MAX).then_some(bytes as u32)
}

/// The most rows of a product whose blocks make their own activations: past
/// them (an output head over a vocabulary) a norm launch makes them once.
/// SmolLM2's head is 12,288 blocks of 4 rows, and each would read and
/// normalise the same token rows again, 4.6 KB of floats and gains and four
/// barriers a block against its 2.4 KB of weights, where one launch of a
/// block a token does it for all of them. A layer's products (960 to 1,536
/// rows in SmolLM2, 8,192 in a 1B model's FFN) are a wave of blocks or two,
/// whose prologues run side by side.
const FUSED_ROWS_MAX: u32 = 16_384;

/// Dynamic shared memory a matmul block may take: the 48 KiB a block has
/// without opting in (only attention opts in), less a KiB for the kernel's
/// own static shared memory (32 bytes today).
const SHARED_DEFAULT_MAX: u64 = SHARED_DEFAULT_BYTES as u64 - 1024;

// The device and the host share one byte order: CUDA runs on x86-64 and
// aarch64 hosts, both little-endian.
const _: () = assert!(cfg!(target_endian = "little"));

/// A 4-byte word type every bit pattern of which is a value.
trait Word: Copy {}
impl Word for u32 {}
impl Word for f32 {}

/// The bytes of `words`, as the device lays them out.
fn le_bytes<T: Word>(words: &[T]) -> &[u8] {
    // SAFETY: u32 and f32 have no padding and the host's byte order is the
    // device's; u8's alignment divides theirs.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// The bytes of `words`, for a copy from the device into them.
fn le_bytes_mut<T: Word>(words: &mut [T]) -> &mut [u8] {
    // SAFETY: as `le_bytes`, and every bit pattern is a u32 or an f32.
    unsafe {
        std::slice::from_raw_parts_mut(
            words.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(words),
        )
    }
}
