//! Re-quantization of a whole GGUF file to Q8_0: a second, more precise model
//! derived from the default one by the project's own reader, block code and
//! writer, so that nothing but the download has to be trusted.
//!
//! What happens to each tensor:
//!
//! ```text
//! 2+ dims, row length % 32 == 0, type != Q8_0  -> dequantize to f32, quantize to Q8_0
//! 2+ dims, already Q8_0                        -> copied (re-quantizing can only lose)
//! 2+ dims, row length not whole Q8_0 blocks    -> copied
//! 1 dim (norm gains)                           -> copied
//! ```
//!
//! Metadata is copied in file order, with `general.file_type` set to
//! [`FILE_TYPE_MOSTLY_Q8_0`] (appended when absent).
//!
//! Invariants:
//! 1. Deterministic: the output depends on the input bytes alone. File order is
//!    kept, conversion uses the scalar reference code (no ISA dispatch, no
//!    threads), and the layout comes from [`GgufStreamWriter`]. Q8_0 blocks
//!    round as ggml's `quantize_row_q8_0_ref`: on SmolLM2 every converted
//!    tensor is byte-identical to what the `gguf` Python package's Q8_0
//!    quantizer makes of the same dequantized weights (checked 2026-11-30).
//! 2. Every converted weight survives the trip: a weight that is not finite or
//!    beyond Q8_0's range ([`Q8_0_ABS_MAX`]) is a [`RequantizeError`], never a
//!    file that decodes to infinities.
//! 3. Memory is one output tensor and one f32 row at a time, never the file:
//!    the header is written from sizes computed up front, then tensors stream.
//! 4. Structural hostility (bad counts, shapes, offsets) was refused by the
//!    reader before a [`Gguf`] existed; the checks here cover only what the
//!    conversion adds, and each is a typed error.

use std::io::Write;

use super::writer::{GgufStreamWriter, TensorEntry};
use super::{Gguf, TensorInfo, Value};
use crate::quant::{self, GgmlType, QuantError, QK32};

/// The metadata key that names a file's predominant weight type.
pub const FILE_TYPE_KEY: &str = "general.file_type";
/// llama.cpp's `LLAMA_FTYPE_MOSTLY_Q8_0`.
pub const FILE_TYPE_MOSTLY_Q8_0: u32 = 7;
/// Longest row (innermost dimension) converted. Real models have rows of at
/// most a few tens of thousands of weights; this bounds the f32 row buffer
/// (64 MiB) whatever a file declares.
pub const ROW_LEN_MAX: u64 = 1 << 24;
/// Largest |weight| Q8_0 can encode: a block's scale `amax / 127` is stored as
/// f16, whose largest finite value is 65504.
pub const Q8_0_ABS_MAX: f32 = 65504.0 * 127.0;

const _: () = assert!(GgmlType::Q8_0.block_len() == QK32);

/// Why a file could not be re-quantized.
#[derive(Debug, thiserror::Error)]
pub enum RequantizeError {
    /// The output could not be written.
    #[error("writing the output: {0}")]
    Io(#[from] std::io::Error),
    /// A weight Q8_0 cannot carry.
    #[error(
        "tensor {name:?} row {row}: weight {value} is not finite or beyond Q8_0's range (|w| <= {Q8_0_ABS_MAX})"
    )]
    Unrepresentable {
        /// The tensor.
        name: String,
        /// The row, counted from 0.
        row: u64,
        /// The offending weight.
        value: f32,
    },
    /// A tensor whose rows or output size exceed what this converter accepts.
    #[error("tensor {name:?}: {reason}")]
    TooLarge {
        /// The tensor.
        name: String,
        /// What is too large.
        reason: String,
    },
    /// The block code refused a row (cannot happen for a file the reader
    /// accepted; kept typed so that a reader bug is an error, not a panic).
    #[error("tensor {name:?}: {source}")]
    Quant {
        /// The tensor.
        name: String,
        /// The cause.
        source: QuantError,
    },
}

/// What [`requantize_q8_0`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequantizeReport {
    /// Tensors converted to Q8_0, counted by their source type, in order of
    /// first appearance in the file.
    pub converted: Vec<(GgmlType, u32)>,
    /// Tensors copied unchanged, counted by type, in order of first appearance.
    pub kept: Vec<(GgmlType, u32)>,
    /// Bytes of tensor data read.
    pub tensor_bytes_in: u64,
    /// Bytes of tensor data written.
    pub tensor_bytes_out: u64,
}

impl RequantizeReport {
    /// Tensors converted.
    pub fn converted_count(&self) -> u32 {
        self.converted.iter().map(|(_, count)| count).sum()
    }

    /// Tensors copied unchanged.
    pub fn kept_count(&self) -> u32 {
        self.kept.iter().map(|(_, count)| count).sum()
    }
}

/// What happens to one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Convert,
    Keep,
}

/// Writes `gguf` re-quantized to Q8_0 (see the module doc) to `out`.
///
/// On error, `out` holds a partial file: the caller writes to a temporary name
/// and renames only on success.
pub fn requantize_q8_0<W: Write>(gguf: &Gguf, out: W) -> Result<RequantizeReport, RequantizeError> {
    let plan = gguf
        .tensors()
        .iter()
        .map(plan_tensor)
        .collect::<Result<Vec<_>, _>>()?;
    let entries: Vec<TensorEntry> = plan.iter().map(|(entry, _)| entry.clone()).collect();
    let mut stream = GgufStreamWriter::new(out, &q8_0_metadata(gguf.metadata()), &entries)?;
    let mut report = RequantizeReport::default();
    // Reused across tensors: the largest output tensor and the longest row.
    let mut converted = Vec::new();
    let mut row = Vec::new();
    for (info, (entry, action)) in gguf.tensors().iter().zip(&plan) {
        let source = gguf.tensor_bytes(info);
        match action {
            Action::Convert => {
                convert_tensor(info, source, &mut row, &mut converted)?;
                stream.tensor(&converted)?;
                count(&mut report.converted, info.ty);
            }
            Action::Keep => {
                stream.tensor(source)?;
                count(&mut report.kept, info.ty);
            }
        }
        report.tensor_bytes_in += info.bytes_len;
        report.tensor_bytes_out += entry.bytes_len;
    }
    stream.finish()?;
    Ok(report)
}

/// The output header of `info` and what to do with its bytes.
fn plan_tensor(info: &TensorInfo) -> Result<(TensorEntry, Action), RequantizeError> {
    let row_len = info.dims[0];
    let convertible =
        info.dims.len() >= 2 && info.ty != GgmlType::Q8_0 && row_len.is_multiple_of(QK32 as u64);
    if !convertible {
        let entry = TensorEntry {
            name: info.name.clone(),
            dims: info.dims.clone(),
            ty: info.ty,
            bytes_len: info.bytes_len,
        };
        return Ok((entry, Action::Keep));
    }
    let too_large = |reason: String| RequantizeError::TooLarge {
        name: info.name.clone(),
        reason,
    };
    if row_len > ROW_LEN_MAX {
        return Err(too_large(format!(
            "rows of {row_len} weights exceed the limit of {ROW_LEN_MAX}"
        )));
    }
    let bytes_len = GgmlType::Q8_0
        .bytes_for(info.elements_count())
        .ok_or_else(|| too_large("its Q8_0 size overflows".to_string()))?;
    let entry = TensorEntry {
        name: info.name.clone(),
        dims: info.dims.clone(),
        ty: GgmlType::Q8_0,
        bytes_len,
    };
    Ok((entry, Action::Convert))
}

/// Dequantizes `source` row by row into `row` and quantizes each into `out`.
fn convert_tensor(
    info: &TensorInfo,
    source: &[u8],
    row: &mut Vec<f32>,
    out: &mut Vec<u8>,
) -> Result<(), RequantizeError> {
    // The reader checked that dims[0] is whole blocks of `info.ty` and that the
    // bytes hold exactly `elements_count` weights; `plan_tensor` bounded dims[0].
    let row_len = info.dims[0] as usize;
    let rows_count = info.elements_count() / info.dims[0];
    let source_row_bytes = row_len / info.ty.block_len() * info.ty.block_bytes();
    let out_row_bytes = row_len / QK32 * GgmlType::Q8_0.block_bytes();
    let quant_error = |source| RequantizeError::Quant {
        name: info.name.clone(),
        source,
    };
    row.clear();
    row.resize(row_len, 0.0);
    out.clear();
    out.resize(rows_count as usize * out_row_bytes, 0);
    let rows = source
        .chunks_exact(source_row_bytes)
        .zip(out.chunks_exact_mut(out_row_bytes));
    for (index, (source_row, out_row)) in rows.enumerate() {
        quant::dequantize_row(info.ty, source_row, row).map_err(quant_error)?;
        if let Some(&value) = row.iter().find(|w| !representable(**w)) {
            return Err(RequantizeError::Unrepresentable {
                name: info.name.clone(),
                row: index as u64,
                value,
            });
        }
        quant::quantize_row(GgmlType::Q8_0, row, out_row).map_err(quant_error)?;
    }
    Ok(())
}

/// Whether Q8_0 can carry `weight`: finite and within [`Q8_0_ABS_MAX`].
fn representable(weight: f32) -> bool {
    weight.is_finite() && weight.abs() <= Q8_0_ABS_MAX
}

/// `metadata` with the file type set to Q8_0.
fn q8_0_metadata(metadata: &[(String, Value)]) -> Vec<(String, Value)> {
    let file_type = Value::U32(FILE_TYPE_MOSTLY_Q8_0);
    let mut out = metadata.to_vec();
    match out.iter_mut().find(|(key, _)| key == FILE_TYPE_KEY) {
        Some((_, value)) => *value = file_type,
        None => out.push((FILE_TYPE_KEY.to_string(), file_type)),
    }
    out
}

fn count(counts: &mut Vec<(GgmlType, u32)>, ty: GgmlType) {
    match counts.iter_mut().find(|(seen, _)| *seen == ty) {
        Some((_, n)) => *n += 1,
        None => counts.push((ty, 1)),
    }
}
