//! Typed errors for caller-supplied lengths and types.

use super::GgmlType;

/// Why a quantization entry point rejected its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element count is not a whole number of the type's blocks.
    #[error("{ty:?}: {len} weights is not a whole number of {block_len}-weight blocks")]
    PartialBlock {
        /// The tensor type.
        ty: GgmlType,
        /// The offending element count.
        len: usize,
        /// Weights per block of `ty`.
        block_len: usize,
    },
    /// The byte buffer does not hold exactly the blocks the element count needs.
    #[error("{ty:?}: {weights} weights need {expected} bytes, got {actual}")]
    ByteLength {
        /// The tensor type.
        ty: GgmlType,
        /// Element count the bytes should encode.
        weights: usize,
        /// Bytes that count needs.
        expected: usize,
        /// Bytes supplied.
        actual: usize,
    },
    /// An activation buffer does not hold `n_tokens * k` values.
    #[error("activations: {n_tokens} tokens x {k} values need {expected} floats, got {actual}")]
    ActivationLength {
        /// Tokens requested.
        n_tokens: usize,
        /// Values per token.
        k: usize,
        /// `n_tokens * k`.
        expected: usize,
        /// Floats supplied.
        actual: usize,
    },
    /// The type has no reference quantizer here.
    #[error("{0:?}: no reference quantizer")]
    Unsupported(GgmlType),
}
