//! Quantized block formats and their dot products.

mod types;

pub use types::GgmlType;
