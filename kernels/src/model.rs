//! The decoder-only transformer families this engine runs: one blueprint
//! ([`ModelConfig`], with each family's differences as typed options) and the
//! immutable weights ([`Model`]), read from a GGUF file and checked against
//! each other.
//!
//! Families (`general.architecture`) and what sets them apart:
//!
//! ```text
//! llama   RoPE on adjacent pairs; optional Llama-3 frequency factors
//!         (`rope_freqs.weight`) and linear RoPE scaling
//! qwen2   RoPE on halves (NEOX); biases on Q, K and V
//! qwen3   RoPE on halves; RMSNorm of each Q and K head before RoPE; head width
//!         from `attention.key_length`, not embedding / heads
//! gemma   RoPE on halves; embeddings scaled by sqrt(d); GELU (tanh) gate;
//!         output head tied to the embedding
//! gemma2  gemma, plus RMSNorm after attention and after the feed-forward
//!         block, soft-capped attention scores and logits, and sliding-window
//!         attention on alternate layers (local layers first)
//! gemma3  gemma2 without attention soft-capping, with per-head Q/K norms as
//!         qwen3, five local layers to one global, a RoPE base of their own
//!         for the local layers, and logit soft-capping only where the file
//!         says so
//! phi3    RoPE on halves; Q, K, V in one fused matrix and gate and up in
//!         another (read as row ranges of it); its sliding window is ignored,
//!         as llama.cpp ignores it
//! ```
//!
//! Every family may carry a fused `attn_qkv.weight` instead of three
//! matrices (llama.cpp reads either).
//!
//! Invariants:
//! 1. A file is run only if every tensor in it is one this blueprint reads: a
//!    tensor the engine does not understand (a bias, a frequency table, an
//!    expert) means the file's model is not the one we would run, so it is
//!    refused with the tensor's name, never run without it.
//! 2. Every option that changes the arithmetic is decided here, at load; the
//!    backends branch on the typed option, never on the architecture's name.
//!
//! Blueprint, weights and scratch are separate types (llama2.c's `Config`,
//! `TransformerWeights`, `RunState`): the forward pass lives in
//! [`crate::backend`], and KV lives only in pool pages ([`crate::kv`]).
//!
//! Quantized matrices stay in the memory map: the engine's kernels read ggml
//! blocks directly, so repacking would only pay for itself with a layout the
//! kernels do not use. Norm vectors are copied out as f32 (a few KiB).

use crate::gguf::{metadata_error, Gguf, GgufError, TensorInfo};
use crate::kv::{KvType, PoolGeometry};
use crate::quant::{self, GgmlType};
use crate::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

/// Largest context length this engine accepts from a model file.
pub const CONTEXT_LEN_MAX: usize = 1 << 20;
/// Largest embedding, feed-forward or vocabulary size accepted.
pub const DIM_MAX: usize = 1 << 20;
/// Most layers accepted.
pub const LAYERS_MAX: usize = 1024;

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file itself is bad.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// An architecture this engine does not run.
    #[error(
        "unsupported architecture {0:?} (supported: llama, qwen2, qwen3, gemma, gemma2, gemma3, \
         phi3)"
    )]
    Architecture(String),
    /// A tensor the blueprint does not read: running without it would
    /// compute another model than the file's.
    #[error(
        "tensor {0:?} is not part of the {1} blueprint this engine runs; refusing the file \
         rather than running it without that tensor"
    )]
    UnknownTensor(String, &'static str),
    /// A metadata option this engine does not implement.
    #[error("{key} = {value}: not supported ({reason})")]
    UnsupportedOption {
        /// The metadata key.
        key: String,
        /// Its value.
        value: String,
        /// What the engine runs instead.
        reason: &'static str,
    },
    /// Hyper-parameters that cannot describe a working model.
    #[error("bad hyper-parameter {key}: {reason}")]
    HyperParameter {
        /// The metadata key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor is missing.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    /// A tensor's shape or type disagrees with the hyper-parameters.
    #[error("tensor {name:?}: shape {found:?} type {ty}, expected {expected:?}")]
    TensorShape {
        /// The tensor.
        name: String,
        /// Its dimensions.
        found: Vec<u64>,
        /// Its type.
        ty: &'static str,
        /// What the architecture needs.
        expected: Vec<u64>,
    },
    /// The tokenizer metadata is unusable.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The tokenizer and the embedding table disagree on the vocabulary: ids
    /// with no embedding row, or rows (and logits) no token decodes to.
    #[error("the tokenizer has {tokens} tokens but the embedding table has {rows} rows")]
    Vocabulary {
        /// Tokens in the tokenizer.
        tokens: usize,
        /// Rows of `token_embd.weight` (and of the output head).
        rows: usize,
    },
}

/// A transformer family the engine runs (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1-3, SmolLM, Mistral (as llama.cpp runs it: full attention).
    Llama,
    /// Qwen 2 and 2.5.
    Qwen2,
    /// Qwen 3 (dense).
    Qwen3,
    /// Gemma (1).
    Gemma,
    /// Gemma 2.
    Gemma2,
    /// Gemma 3 (text).
    Gemma3,
    /// Phi 3 and 3.5 (dense, without LongRoPE).
    Phi3,
}

impl Architecture {
    /// The `general.architecture` name.
    pub const fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma => "gemma",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3",
            Architecture::Phi3 => "phi3",
        }
    }

    /// Every family, in the order the docs list them.
    pub const ALL: [Architecture; 7] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Phi3,
    ];

    fn is_gemma(self) -> bool {
        matches!(
            self,
            Architecture::Gemma | Architecture::Gemma2 | Architecture::Gemma3
        )
    }

    fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// Which of a head's dimensions RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: ggml's normal mode (llama).
    Adjacent,
    /// Pairs `(i, i + rope_dim / 2)`: ggml's NEOX mode (every family but llama).
    Halves,
}

/// The activation of the feed-forward block's gate: `act(x·Wg) * x·Wu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU): `x/2 · (1 + tanh(sqrt(2/pi) · (x + 0.044715 x^3)))`.
    GeluTanh,
}

/// Sliding-window attention: which layers are local, and what they see.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a token of a local layer attends to, itself included: the
    /// token at `p` sees `p + 1 - window ..= p` (llama.cpp's `n_swa`).
    pub window: usize,
    /// `local[layer]`: whether the layer is local (the others see the whole
    /// context).
    pub local: Vec<bool>,
    /// RoPE base frequency of the local layers.
    pub rope_base: f32,
    /// RoPE angle multiplier of the local layers.
    pub rope_freq_scale: f32,
}

impl SlidingWindow {
    /// The window of `layer`, if it is local.
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        self.local[layer].then_some(self.window)
    }
}

/// The blueprint: hyper-parameters and the family's options.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family.
    pub architecture: Architecture,
    /// Transformer blocks.
    pub layers_count: usize,
    /// Width of the residual stream (`d`).
    pub embedding_len: usize,
    /// Query heads.
    pub heads_count: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub kv_heads_count: usize,
    /// Width of one head (`d / heads` unless the file says otherwise).
    pub head_dim: usize,
    /// Hidden width of the SwiGLU feed-forward block.
    pub ffn_len: usize,
    /// Tokens in the vocabulary (rows of the embedding).
    pub vocab_len: usize,
    /// Context length the model was trained for.
    pub context_len: usize,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// Leading dimensions of each head that RoPE rotates.
    pub rope_dim: usize,
    /// Which dimensions RoPE pairs.
    pub rope_style: RopeStyle,
    /// Multiplies every RoPE angle (linear scaling: `1 / factor`; else 1).
    pub rope_freq_scale: f32,
    /// Llama-3's per-pair frequency divisors, `[rope_dim / 2]`, from
    /// `rope_freqs.weight`.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Q, K and V projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// Each Q and K head is RMS-normalised before RoPE (qwen3, gemma3).
    pub qk_norm: bool,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Multiplies each token's embedding row (gemma: `sqrt(d)`; else 1).
    pub embedding_scale: f32,
    /// The feed-forward gate's activation.
    pub activation: Activation,
    /// The outputs of attention and of the feed-forward block are
    /// RMS-normalised before the residual add (gemma2, gemma3).
    pub post_norms: bool,
    /// Multiplies `q·k` (`1 / sqrt(head_dim)` but for Gemma 2/3 27B, see
    /// `attention_scale` in this module).
    pub attention_scale: f32,
    /// Attention scores become `cap · tanh(score / cap)` before the softmax.
    pub attention_softcap: Option<f32>,
    /// Logits become `cap · tanh(logit / cap)`.
    pub final_softcap: Option<f32>,
    /// Local layers and their window (gemma2, gemma3).
    pub sliding_window: Option<SlidingWindow>,
}

impl ModelConfig {
    /// Reads and checks the hyper-parameters and options of a file.
    pub fn from_gguf(gguf: &Gguf) -> Result<ModelConfig, ModelError> {
        let arch_name = gguf.str("general.architecture")?;
        let architecture = Architecture::from_name(arch_name)
            .ok_or_else(|| ModelError::Architecture(arch_name.to_string()))?;
        let arch = architecture.name();
        let key = |name: &str| format!("{arch}.{name}");
        let dim = |name: &str, max: usize| -> Result<usize, ModelError> {
            let key = key(name);
            let value = gguf.u64(&key)?;
            if value == 0 || value > max as u64 {
                return Err(hyper(&key, format!("{value} is outside 1..={max}")));
            }
            Ok(value as usize)
        };
        let embedding_len = dim("embedding_length", DIM_MAX)?;
        let heads_count = dim("attention.head_count", DIM_MAX)?;
        let kv_heads_count = match gguf.get(&key("attention.head_count_kv")) {
            Some(_) => dim("attention.head_count_kv", DIM_MAX)?,
            None => heads_count,
        };
        if heads_count % kv_heads_count != 0 {
            return Err(hyper(
                &key("attention.head_count_kv"),
                "does not divide head_count",
            ));
        }
        let head_dim = match gguf.get(&key("attention.key_length")) {
            Some(_) => dim("attention.key_length", DIM_MAX)?,
            None if embedding_len % heads_count == 0 => embedding_len / heads_count,
            None => {
                return Err(hyper(
                    &key("attention.head_count"),
                    "does not divide embedding_length",
                ))
            }
        };
        if gguf.get(&key("attention.value_length")).is_some()
            && dim("attention.value_length", DIM_MAX)? != head_dim
        {
            return Err(hyper(
                &key("attention.value_length"),
                "differs from the key length",
            ));
        }
        let rope_dim = match gguf.get(&key("rope.dimension_count")) {
            Some(_) => dim("rope.dimension_count", head_dim)?,
            None => head_dim,
        };
        if rope_dim % 2 != 0 {
            return Err(hyper(&key("rope.dimension_count"), "must be even"));
        }
        let vocab_len = match gguf.tensor("token_embd.weight") {
            Some(t) if t.dims.len() == 2 && t.dims[1] as usize <= DIM_MAX => t.dims[1] as usize,
            Some(_) => return Err(hyper("token_embd.weight", "expected two dimensions")),
            None => return Err(ModelError::MissingTensor("token_embd.weight".into())),
        };
        let float = |key: &str, default: f64| -> Result<f32, ModelError> {
            let value = match gguf.get(key) {
                Some(_) => gguf.f64(key)?,
                None => default,
            };
            if !value.is_finite() || value <= 0.0 {
                return Err(hyper(key, format!("{value} must be a positive number")));
            }
            Ok(value as f32)
        };
        refuse_unrun_options(gguf, architecture)?;
        let rope_freq_scale = rope_freq_scale(gguf, arch)?;
        let rope_freq_factors = rope_freq_factors(gguf, rope_dim)?;
        if rope_freq_factors.is_some() && architecture != Architecture::Llama {
            return Err(ModelError::UnknownTensor(ROPE_FREQS.into(), arch));
        }
        let layers_count = dim("block_count", LAYERS_MAX)?;
        let rope_base = float(&key("rope.freq_base"), 10_000.0)?;
        // A cap of 0 means none (llama.cpp's test for gemma3's).
        let softcap = |name: &str, default: Option<f64>| -> Result<Option<f32>, ModelError> {
            let key = key(name);
            let cap = match gguf.get(&key) {
                Some(_) => gguf.f64(&key)?,
                None => return Ok(default.map(|d| d as f32)),
            };
            match cap {
                0.0 if architecture == Architecture::Gemma3 => Ok(None),
                cap if cap.is_finite() && cap > 0.0 => Ok(Some(cap as f32)),
                cap => Err(hyper(&key, format!("{cap} must be a positive number"))),
            }
        };
        // Defaults as llama.cpp's: gemma2 caps at 50 and 30 unless the file
        // says otherwise; gemma3 caps logits only where the file says so.
        let (attention_softcap, final_softcap) = match architecture {
            Architecture::Gemma2 => (
                softcap("attn_logit_softcapping", Some(50.0))?,
                softcap("final_logit_softcapping", Some(30.0))?,
            ),
            Architecture::Gemma3 => (None, softcap("final_logit_softcapping", None)?),
            _ => (None, None),
        };
        let sliding_window =
            sliding_window(gguf, architecture, layers_count, rope_base, rope_freq_scale)?;
        Ok(ModelConfig {
            architecture,
            layers_count,
            embedding_len,
            heads_count,
            kv_heads_count,
            head_dim,
            ffn_len: dim("feed_forward_length", DIM_MAX)?,
            vocab_len,
            context_len: dim("context_length", CONTEXT_LEN_MAX)?,
            rope_base,
            rope_dim,
            rope_style: match architecture {
                Architecture::Llama => RopeStyle::Adjacent,
                _ => RopeStyle::Halves,
            },
            rope_freq_scale,
            rope_freq_factors,
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            rms_eps: float(&key("attention.layer_norm_rms_epsilon"), 1e-5)?,
            embedding_scale: match architecture.is_gemma() {
                true => (embedding_len as f32).sqrt(),
                false => 1.0,
            },
            activation: match architecture.is_gemma() {
                true => Activation::GeluTanh,
                false => Activation::Silu,
            },
            post_norms: matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3),
            attention_scale: attention_scale(
                architecture,
                layers_count,
                embedding_len,
                heads_count,
                head_dim,
            ),
            attention_softcap,
            final_softcap,
            sliding_window,
        })
    }

    /// One line for an operator: the family, its shape, and its local layers.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{}, {} layers, {} query and {} KV heads of width {}",
            self.architecture.name(),
            self.layers_count,
            self.heads_count,
            self.kv_heads_count,
            self.head_dim,
        );
        if let Some(window) = &self.sliding_window {
            let local = window.local.iter().filter(|l| **l).count();
            text += &format!(
                "; {local} of {} layers local, attending to the last {} positions (their \
                 K and V are kept for every position, as the other layers')",
                self.layers_count, window.window
            );
        }
        text
    }

    /// Width of the query projection and of attention's output: `heads * head_dim`.
    pub fn q_len(&self) -> usize {
        self.heads_count * self.head_dim
    }

    /// Width of the key (and value) projection: `kv_heads_count * head_dim`.
    pub fn kv_len(&self) -> usize {
        self.kv_heads_count * self.head_dim
    }

    /// The KV pool geometry for this model: `pages_count` pages of `page_tokens`
    /// positions, each holding K and V of every layer and KV head as `kv_type`.
    pub fn pool_geometry(
        &self,
        pages_count: u32,
        page_tokens: u32,
        kv_type: KvType,
    ) -> PoolGeometry {
        PoolGeometry {
            kv_type,
            pages_count,
            page_tokens,
            // Bounded by LAYERS_MAX and DIM_MAX at load, so these fit in u32.
            layers: self.layers_count as u32,
            kv_heads: self.kv_heads_count as u32,
            head_dim: self.head_dim as u32,
        }
    }

    /// Query heads that share one key/value head.
    pub fn kv_group(&self) -> usize {
        self.heads_count / self.kv_heads_count
    }
}

/// The tensor that carries Llama-3's RoPE frequency factors.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// `q·k` scale: `1 / sqrt(head_dim)`, except that Gemma 2 and 3 27B (told
/// apart by their layer counts, as llama.cpp and gemma_pytorch do) scale by
/// `1 / sqrt(d / heads)`.
fn attention_scale(
    architecture: Architecture,
    layers: usize,
    d: usize,
    heads: usize,
    head_dim: usize,
) -> f32 {
    let is_27b = matches!(
        (architecture, layers),
        (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62)
    );
    match is_27b {
        true => 1.0 / ((d / heads) as f32).sqrt(),
        false => 1.0 / (head_dim as f32).sqrt(),
    }
}

/// Gemma 2 and 3's local layers, read as llama.cpp reads them:
/// `attention.sliding_window` (gemma2 defaults to 4096; gemma3 has none
/// without it), `attention.sliding_window_pattern` as one flag per layer or as
/// a period `n` (layer `i` is local unless `i % n == n - 1`; gemma2 defaults
/// to 2, gemma3 to 6), and `rope.freq_base_swa` (gemma2 defaults to the
/// global base and scale; gemma3 to 10,000 and no scaling).
fn sliding_window(
    gguf: &Gguf,
    architecture: Architecture,
    layers: usize,
    rope_base: f32,
    rope_freq_scale: f32,
) -> Result<Option<SlidingWindow>, ModelError> {
    let arch = architecture.name();
    let window_key = format!("{arch}.attention.sliding_window");
    let (default_window, period, local_base, local_scale) = match architecture {
        Architecture::Gemma2 => (Some(4096), 2, rope_base, rope_freq_scale),
        Architecture::Gemma3 => (None, 6, 10_000.0, 1.0),
        // llama.cpp runs phi3 (and llama: Mistral) with full attention
        // whatever window the file declares; so do we.
        _ => return Ok(None),
    };
    let window = match gguf.get(&window_key) {
        Some(_) => Some(gguf.u64(&window_key)?),
        None => default_window,
    };
    let window = match window {
        None => return Ok(None),
        // gemma3 without a window (or with 0) attends globally everywhere.
        Some(0) if architecture == Architecture::Gemma3 => return Ok(None),
        Some(w) if w == 0 || w > CONTEXT_LEN_MAX as u64 => {
            return Err(hyper(
                &window_key,
                format!("{w} is outside 1..={CONTEXT_LEN_MAX}"),
            ))
        }
        Some(w) => w as usize,
    };
    let pattern_key = format!("{arch}.attention.sliding_window_pattern");
    let local = match gguf.get(&pattern_key) {
        Some(crate::gguf::Value::Array(flags)) => {
            let flags: Option<Vec<bool>> = flags
                .iter()
                .map(|f| match f {
                    crate::gguf::Value::Bool(b) => Some(*b),
                    _ => None,
                })
                .collect();
            match flags {
                Some(flags) if flags.len() == layers => flags,
                _ => return Err(hyper(&pattern_key, "expected one boolean per layer")),
            }
        }
        Some(_) => periodic(gguf.u64(&pattern_key)?, layers),
        None => periodic(period, layers),
    };
    let base_key = format!("{arch}.rope.freq_base_swa");
    let rope_base = match gguf.get(&base_key) {
        Some(_) => {
            let base = gguf.f64(&base_key)?;
            if !base.is_finite() || base <= 0.0 {
                return Err(hyper(
                    &base_key,
                    format!("{base} must be a positive number"),
                ));
            }
            base as f32
        }
        None => local_base,
    };
    Ok(Some(SlidingWindow {
        window,
        local,
        rope_base,
        rope_freq_scale: local_scale,
    }))
}

/// llama.cpp's `set_swa_pattern(n)`: every layer local for 0, else layer `i`
/// is local unless it is the last of each run of `n`.
fn periodic(period: u64, layers: usize) -> Vec<bool> {
    (0..layers as u64)
        .map(|i| period == 0 || i % period < period - 1)
        .collect()
}

/// Metadata that changes the arithmetic in ways this engine does not run.
fn refuse_unrun_options(gguf: &Gguf, architecture: Architecture) -> Result<(), ModelError> {
    let arch = architecture.name();
    let unsupported = |key: String, reason: &'static str| -> Result<(), ModelError> {
        let value = match gguf.get(&key) {
            Some(crate::gguf::Value::String(s)) => s.clone(),
            Some(other) => format!("{other:?}"),
            None => return Ok(()),
        };
        Err(ModelError::UnsupportedOption { key, value, reason })
    };
    if gguf.get(&format!("{arch}.expert_count")).is_some()
        && gguf.u64(&format!("{arch}.expert_count"))? > 0
    {
        unsupported(
            format!("{arch}.expert_count"),
            "mixture-of-experts feed-forward blocks are not run",
        )?;
    }
    // Soft-capping is read for the families llama.cpp applies it to; a
    // file of another family that declares it is not one llama.cpp or we
    // would run as its authors meant.
    if architecture != Architecture::Gemma2 {
        unsupported(
            format!("{arch}.attn_logit_softcapping"),
            "attention soft-capping is run only for gemma2",
        )?;
    }
    if !matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3) {
        unsupported(
            format!("{arch}.final_logit_softcapping"),
            "logit soft-capping is run only for gemma2 and gemma3",
        )?;
    }
    unsupported(
        format!("{arch}.attention.scale"),
        "attention scales other than the family's are not run",
    )?;
    unsupported(
        format!("{arch}.embedding_scale"),
        "embedding scales other than the family's are not run",
    )?;
    Ok(())
}

/// `{arch}.rope.scaling.type` and its factor, as llama.cpp reads them: the type
/// defaults to linear, the factor comes from `rope.scaling.factor` (or the
/// older `rope.scale_linear`), and every angle is divided by it for `none` and
/// `linear` alike. Other types (YaRN, LongRoPE) are refused.
fn rope_freq_scale(gguf: &Gguf, arch: &str) -> Result<f32, ModelError> {
    let type_key = format!("{arch}.rope.scaling.type");
    let kind = match gguf.get(&type_key) {
        Some(_) => gguf.str(&type_key)?.to_string(),
        None => "linear".to_string(),
    };
    if kind != "none" && kind != "linear" {
        return Err(ModelError::UnsupportedOption {
            key: type_key,
            value: kind,
            reason: "RoPE scaling other than linear (and Llama-3's frequency factors) is not run",
        });
    }
    let mut factor = 0.0;
    for key in ["rope.scaling.factor", "rope.scale_linear"].map(|k| format!("{arch}.{k}")) {
        if gguf.get(&key).is_some() {
            factor = gguf.f64(&key)? as f32;
            if !factor.is_finite() || factor < 0.0 {
                return Err(hyper(&key, format!("{factor} must be a positive number")));
            }
            break;
        }
    }
    Ok(if factor == 0.0 { 1.0 } else { 1.0 / factor })
}

/// Llama-3's `rope_freqs.weight`: `[rope_dim / 2]` positive divisors.
fn rope_freq_factors(gguf: &Gguf, rope_dim: usize) -> Result<Option<Vec<f32>>, ModelError> {
    if gguf.tensor(ROPE_FREQS).is_none() {
        return Ok(None);
    }
    let factors = vector(gguf, ROPE_FREQS, rope_dim / 2)?;
    if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
        return Err(hyper(ROPE_FREQS, "every factor must be a positive number"));
    }
    Ok(Some(factors))
}

fn hyper(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::HyperParameter {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// A weight matrix `[rows][cols]` in ggml blocks, left in the file.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// The tensor's header (its bytes are read through the model's file).
    pub info: TensorInfo,
    /// Output features.
    pub rows: usize,
    /// Input features (the dot-product length).
    pub cols: usize,
}

impl Matrix {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.info.bytes_len as usize / self.rows
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm gain before attention, `[d]`.
    pub attn_norm: Vec<f32>,
    /// `[q_len][d]`.
    pub wq: Matrix,
    /// `[kv_len][d]`.
    pub wk: Matrix,
    /// `[kv_len][d]`.
    pub wv: Matrix,
    /// Biases of Q, K and V, `[q_len]`, `[kv_len]`, `[kv_len]` (when `qkv_bias`).
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// RMSNorm gains of each Q head and each K head, `[head_dim]` each (when `qk_norm`).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// `[d][q_len]`.
    pub wo: Matrix,
    /// RMSNorm gain of attention's output, `[d]` (when `post_norms`).
    pub attn_post_norm: Option<Vec<f32>>,
    /// RMSNorm gain before the feed-forward block, `[d]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn][d]`.
    pub w_gate: Matrix,
    /// `[ffn][d]`.
    pub w_up: Matrix,
    /// `[d][ffn]`.
    pub w_down: Matrix,
    /// RMSNorm gain of the feed-forward block's output, `[d]` (when `post_norms`).
    pub ffn_post_norm: Option<Vec<f32>>,
}

/// The weights: immutable after load, shared by every backend thread.
pub struct Model {
    /// The hyper-parameters.
    pub config: ModelConfig,
    /// The file the matrices live in.
    pub gguf: Arc<Gguf>,
    /// `[vocab][d]`.
    pub token_embd: Matrix,
    /// Final RMSNorm gain, `[d]`.
    pub output_norm: Vec<f32>,
    /// `[vocab][d]`; the embedding itself when the model ties them.
    pub output: Matrix,
    /// The blocks, in order.
    pub layers: Vec<LayerWeights>,
    /// Matrices repacked for the AVX-512 16-row kernels, made once by the
    /// first CPU backend that runs them ([`Model::repacked`]) and shared by
    /// every backend rebuilt after.
    repacked: std::sync::OnceLock<Repacked>,
}

/// Matrices in the 16-row layouts of `quant::repack`, by the matrix (its
/// bytes' offset and length in the file: a fused tensor's parts apart).
#[derive(Default)]
pub struct Repacked {
    matrices: std::collections::HashMap<(u64, u64), quant::repack::Packed>,
}

impl Repacked {
    /// `matrix` in its 16-row layout, if it was repacked.
    pub fn get(&self, matrix: &Matrix) -> Option<&[u8]> {
        self.matrices
            .get(&(matrix.info.offset, matrix.info.bytes_len))
            .map(|p| p.bytes())
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.matrices.values().map(|m| m.bytes().len() as u64).sum()
    }
}

/// Bytes a file's repackable matrices take beyond their own once repacked
/// (`quant::repack::repacked_len`), for the memory budget of a model the
/// AVX-512 CPU backend runs. An untied token embedding, read a row at a time,
/// stays as it is; a tied one is repacked as the output head and kept too
/// (its rows are still looked up), so its packed copy counts whole.
pub fn repack_overhead_bytes(gguf: &Gguf) -> u64 {
    let tied = !gguf.tensors().iter().any(|t| t.name == "output.weight");
    gguf.tensors()
        .iter()
        .filter(|t| t.dims.len() == 2 && (tied || t.name != "token_embd.weight"))
        .filter_map(|t| {
            let packed =
                quant::repack::repacked_len(t.ty, t.dims[1] as usize, t.dims[0] as usize)? as u64;
            Some(match t.name.as_str() {
                "token_embd.weight" => packed,
                _ => packed.saturating_sub(t.bytes_len),
            })
        })
        .sum()
}

/// Reads tensors by name and remembers which were read (invariant 1).
struct Reader<'a> {
    gguf: &'a Gguf,
    read: std::collections::HashSet<String>,
}

impl Reader<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        self.read.insert(name.to_string());
        matrix(self.gguf, name, rows, cols)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        self.read.insert(name.to_string());
        vector(self.gguf, name, len)
    }

    /// A matrix of `parts.iter().sum()` rows, returned as consecutive row
    /// ranges of `parts[i]` rows each (a fused QKV or gate-up tensor: its
    /// rows are whole blocks each, so each range is contiguous bytes).
    fn split<const N: usize>(
        &mut self,
        name: &str,
        parts: [usize; N],
        cols: usize,
    ) -> Result<[Matrix; N], ModelError> {
        let whole = self.matrix(name, parts.iter().sum(), cols)?;
        let row_bytes = whole.row_bytes() as u64;
        let mut first = 0;
        Ok(parts.map(|rows| {
            let mut info = whole.info.clone();
            info.name = format!("{name}[{first}..{}]", first + rows);
            info.dims = vec![cols as u64, rows as u64];
            info.offset += first as u64 * row_bytes;
            info.bytes_len = rows as u64 * row_bytes;
            first += rows;
            Matrix { info, rows, cols }
        }))
    }

    fn layer(&mut self, c: &ModelConfig, i: usize) -> Result<LayerWeights, ModelError> {
        let (d, q, kv, ffn) = (c.embedding_len, c.q_len(), c.kv_len(), c.ffn_len);
        let name = |part: &str| format!("blk.{i}.{part}");
        let qkv_bias = match c.qkv_bias {
            true => Some([
                self.vector(&name("attn_q.bias"), q)?,
                self.vector(&name("attn_k.bias"), kv)?,
                self.vector(&name("attn_v.bias"), kv)?,
            ]),
            false => None,
        };
        let qk_norm = match c.qk_norm {
            true => Some([
                self.vector(&name("attn_q_norm.weight"), c.head_dim)?,
                self.vector(&name("attn_k_norm.weight"), c.head_dim)?,
            ]),
            false => None,
        };
        let fused_qkv = name("attn_qkv.weight");
        let [wq, wk, wv] = match self.gguf.tensor(&fused_qkv) {
            Some(_) => self.split(&fused_qkv, [q, kv, kv], d)?,
            None => [
                self.matrix(&name("attn_q.weight"), q, d)?,
                self.matrix(&name("attn_k.weight"), kv, d)?,
                self.matrix(&name("attn_v.weight"), kv, d)?,
            ],
        };
        // phi3's up matrix is gate and up, gate first (ggml_swiglu's halves).
        let [w_gate, w_up] = match c.architecture {
            Architecture::Phi3 => self.split(&name("ffn_up.weight"), [ffn, ffn], d)?,
            _ => [
                self.matrix(&name("ffn_gate.weight"), ffn, d)?,
                self.matrix(&name("ffn_up.weight"), ffn, d)?,
            ],
        };
        let mut post_norm = |part: &str| match c.post_norms {
            true => self.vector(&name(part), d).map(Some),
            false => Ok(None),
        };
        let attn_post_norm = post_norm("post_attention_norm.weight")?;
        let ffn_post_norm = post_norm("post_ffw_norm.weight")?;
        Ok(LayerWeights {
            attn_norm: self.vector(&name("attn_norm.weight"), d)?,
            wq,
            wk,
            wv,
            qkv_bias,
            qk_norm,
            wo: self.matrix(&name("attn_output.weight"), d, q)?,
            attn_post_norm,
            ffn_norm: self.vector(&name("ffn_norm.weight"), d)?,
            w_gate,
            w_up,
            w_down: self.matrix(&name("ffn_down.weight"), d, ffn)?,
            ffn_post_norm,
        })
    }
}

impl Model {
    /// Maps `path` and loads the model in it.
    pub fn open(path: &Path) -> Result<Model, ModelError> {
        Model::load(Arc::new(Gguf::open(path)?))
    }

    /// Loads the model in an already parsed file.
    pub fn load(gguf: Arc<Gguf>) -> Result<Model, ModelError> {
        let config = ModelConfig::from_gguf(&gguf)?;
        let (d, vocab) = (config.embedding_len, config.vocab_len);
        let mut reader = Reader {
            gguf: &gguf,
            read: std::collections::HashSet::new(),
        };
        if config.rope_freq_factors.is_some() {
            reader.read.insert(ROPE_FREQS.to_string());
        }
        let token_embd = reader.matrix("token_embd.weight", vocab, d)?;
        // gemma and gemma2 always tie the head (llama.cpp reads no
        // `output.weight` for them, so one in the file is refused as unknown).
        let tied = matches!(
            config.architecture,
            Architecture::Gemma | Architecture::Gemma2
        );
        let output = match gguf.tensor("output.weight") {
            Some(_) if !tied => reader.matrix("output.weight", vocab, d)?,
            _ => token_embd.clone(),
        };
        let layers = (0..config.layers_count)
            .map(|i| reader.layer(&config, i))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let output_norm = reader.vector("output_norm.weight", d)?;
        let arch = config.architecture.name();
        if let Some(unread) = gguf
            .tensors()
            .iter()
            .find(|t| !reader.read.contains(&t.name))
        {
            return Err(ModelError::UnknownTensor(unread.name.clone(), arch));
        }
        Ok(Model {
            output_norm,
            config,
            token_embd,
            output,
            layers,
            gguf,
            repacked: std::sync::OnceLock::new(),
        })
    }

    /// The same weights read under another blueprint (the conformance
    /// canaries: a model changed in one option must be told apart).
    pub fn with_config(&self, config: ModelConfig) -> Model {
        Model {
            config,
            gguf: Arc::clone(&self.gguf),
            token_embd: self.token_embd.clone(),
            output_norm: self.output_norm.clone(),
            output: self.output.clone(),
            layers: self.layers.clone(),
            repacked: std::sync::OnceLock::new(),
        }
    }

    /// Its matrices in the 16-row layouts of the AVX-512 kernels, made on the
    /// first call, one after another, each by up to `threads` threads. The
    /// token embedding only as the output head when tied: its rows are read
    /// one at a time, from the file (whose pages of it fault back in as rows
    /// are looked up).
    pub fn repacked(&self, threads: usize) -> &Repacked {
        self.repacked.get_or_init(|| {
            let mut repacked = Repacked::default();
            let key_of = |m: &Matrix| (m.info.offset, m.info.bytes_len);
            let tied = key_of(&self.token_embd) == key_of(&self.output);
            for matrix in self.matrices() {
                let key = key_of(matrix);
                let embedding_only = key == key_of(&self.token_embd) && !tied;
                if embedding_only || repacked.matrices.contains_key(&key) {
                    continue;
                }
                let (ty, bytes) = (matrix.ty(), self.bytes(matrix));
                let (rows, k) = (matrix.rows, matrix.cols);
                if let Some(packed) = quant::repack::repack(ty, bytes, rows, k, threads) {
                    repacked.matrices.insert(key, packed);
                    // Nothing reads the file's copy again: give its pages back.
                    self.gguf.release(&matrix.info);
                }
            }
            repacked
        })
    }

    /// Every weight matrix, the output head last (the embedding again when tied).
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
        std::iter::once(&self.token_embd)
            .chain(layers)
            .chain(std::iter::once(&self.output))
    }

    /// The bytes of a matrix.
    pub fn bytes(&self, matrix: &Matrix) -> &[u8] {
        self.gguf.tensor_bytes(&matrix.info)
    }

    /// Refuses `tokenizer` unless its vocabulary is exactly the embedding's
    /// rows: a larger one hands out ids the model has no row for (every step
    /// with one fails, whoever else is in the batch), a smaller one lets the
    /// model sample ids no token decodes to.
    pub fn check_tokenizer(&self, tokenizer: &Tokenizer) -> Result<(), ModelError> {
        let (tokens, rows) = (tokenizer.vocab_len(), self.config.vocab_len);
        if tokens != rows {
            return Err(ModelError::Vocabulary { tokens, rows });
        }
        Ok(())
    }

    /// Writes the embedding of `token` into `out` (`[d]`).
    pub fn embed(&self, token: u32, out: &mut [f32]) {
        let embd = &self.token_embd;
        assert!(
            (token as usize) < embd.rows,
            "token id checked by the caller"
        );
        let row_bytes = embd.row_bytes();
        let start = token as usize * row_bytes;
        let row = &self.bytes(embd)[start..start + row_bytes];
        quant::dequantize_row(embd.ty(), row, out).expect("row length checked at load");
    }
}

fn shape_error(info: &TensorInfo, expected: Vec<u64>) -> ModelError {
    ModelError::TensorShape {
        name: info.name.clone(),
        found: info.dims.clone(),
        ty: info.ty.name(),
        expected,
    }
}

fn matrix(gguf: &Gguf, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
    let info = gguf
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let expected = vec![cols as u64, rows as u64];
    if info.dims != expected {
        return Err(shape_error(info, expected));
    }
    Ok(Matrix {
        info: info.clone(),
        rows,
        cols,
    })
}

fn vector(gguf: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let info = gguf
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if info.dims != [len as u64] {
        return Err(shape_error(info, vec![len as u64]));
    }
    let mut out = vec![0.0; len];
    quant::dequantize_row(info.ty, gguf.tensor_bytes(info), &mut out)
        .map_err(|_| shape_error(info, vec![len as u64]))?;
    Ok(out)
}

/// Reads a metadata key that must be a string array (used by the tokenizer loader).
pub fn string_array(gguf: &Gguf, key: &str) -> Result<Vec<String>, GgufError> {
    gguf.array(key)?
        .iter()
        .map(|value| match value {
            crate::gguf::Value::String(s) => Ok(s.clone()),
            _ => Err(metadata_error(key, "expected an array of strings")),
        })
        .collect()
}
