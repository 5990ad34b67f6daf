//! The Llama architecture: its blueprint ([`LlamaConfig`]) and its immutable
//! weights ([`Model`]), read from a GGUF file and checked against each other.
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
    /// An architecture other than `llama`.
    #[error("unsupported architecture {0:?} (supported: llama)")]
    Architecture(String),
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

/// The blueprint: hyper-parameters of a Llama-architecture model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers_count: usize,
    /// Width of the residual stream (`d`).
    pub embedding_len: usize,
    /// Query heads.
    pub heads_count: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub kv_heads_count: usize,
    /// Width of one head.
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
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl LlamaConfig {
    /// Reads and checks the hyper-parameters of a `llama` file.
    pub fn from_gguf(gguf: &Gguf) -> Result<LlamaConfig, ModelError> {
        let arch = gguf.str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Architecture(arch.to_string()));
        }
        let dim = |key: &str, max: usize| -> Result<usize, ModelError> {
            let key = format!("llama.{key}");
            let value = gguf.u64(&key)?;
            if value == 0 || value > max as u64 {
                return Err(hyper(&key, format!("{value} is outside 1..={max}")));
            }
            Ok(value as usize)
        };
        let embedding_len = dim("embedding_length", DIM_MAX)?;
        let heads_count = dim("attention.head_count", DIM_MAX)?;
        let kv_heads_count = match gguf.get("llama.attention.head_count_kv") {
            Some(_) => dim("attention.head_count_kv", DIM_MAX)?,
            None => heads_count,
        };
        if embedding_len % heads_count != 0 {
            return Err(hyper(
                "llama.attention.head_count",
                "does not divide embedding_length",
            ));
        }
        if heads_count % kv_heads_count != 0 {
            return Err(hyper(
                "llama.attention.head_count_kv",
                "does not divide head_count",
            ));
        }
        let head_dim = embedding_len / heads_count;
        let rope_dim = match gguf.get("llama.rope.dimension_count") {
            Some(_) => dim("rope.dimension_count", head_dim)?,
            None => head_dim,
        };
        if rope_dim % 2 != 0 {
            return Err(hyper("llama.rope.dimension_count", "must be even"));
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
        Ok(LlamaConfig {
            layers_count: dim("block_count", LAYERS_MAX)?,
            embedding_len,
            heads_count,
            kv_heads_count,
            head_dim,
            ffn_len: dim("feed_forward_length", DIM_MAX)?,
            vocab_len,
            context_len: dim("context_length", CONTEXT_LEN_MAX)?,
            rope_base: float("llama.rope.freq_base", 10_000.0)?,
            rope_dim,
            rms_eps: float("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
        })
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
    /// `[d][d]`.
    pub wq: Matrix,
    /// `[kv_len][d]`.
    pub wk: Matrix,
    /// `[kv_len][d]`.
    pub wv: Matrix,
    /// `[d][d]`.
    pub wo: Matrix,
    /// RMSNorm gain before the feed-forward block, `[d]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn][d]`.
    pub w_gate: Matrix,
    /// `[ffn][d]`.
    pub w_up: Matrix,
    /// `[d][ffn]`.
    pub w_down: Matrix,
}

/// The weights: immutable after load, shared by every backend thread.
pub struct Model {
    /// The hyper-parameters.
    pub config: LlamaConfig,
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
}

impl Model {
    /// Maps `path` and loads the model in it.
    pub fn open(path: &Path) -> Result<Model, ModelError> {
        Model::load(Arc::new(Gguf::open(path)?))
    }

    /// Loads the model in an already parsed file.
    pub fn load(gguf: Arc<Gguf>) -> Result<Model, ModelError> {
        let config = LlamaConfig::from_gguf(&gguf)?;
        let (d, kv, ffn, vocab) = (
            config.embedding_len,
            config.kv_len(),
            config.ffn_len,
            config.vocab_len,
        );
        let matrix = |name: &str, rows: usize, cols: usize| matrix(&gguf, name, rows, cols);
        let vector = |name: &str| vector(&gguf, name, d);
        let token_embd = matrix("token_embd.weight", vocab, d)?;
        let output = match gguf.tensor("output.weight") {
            Some(_) => matrix("output.weight", vocab, d)?,
            None => token_embd.clone(),
        };
        let layers = (0..config.layers_count)
            .map(|i| {
                let name = |part: &str| format!("blk.{i}.{part}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(&name("attn_norm"))?,
                    wq: matrix(&name("attn_q"), d, d)?,
                    wk: matrix(&name("attn_k"), kv, d)?,
                    wv: matrix(&name("attn_v"), kv, d)?,
                    wo: matrix(&name("attn_output"), d, d)?,
                    ffn_norm: vector(&name("ffn_norm"))?,
                    w_gate: matrix(&name("ffn_gate"), ffn, d)?,
                    w_up: matrix(&name("ffn_up"), ffn, d)?,
                    w_down: matrix(&name("ffn_down"), d, ffn)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Model {
            output_norm: vector("output_norm.weight")?,
            config,
            token_embd,
            output,
            layers,
            gguf,
        })
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
