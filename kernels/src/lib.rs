//! Bulkhead's native engine: the data plane.
//!
//! This crate computes; it does not decide. It knows nothing of HTTP, tenant
//! names or WebAssembly: owners of KV pages are opaque tags, and the host's
//! scheduler is the only caller of [`kv`].
//!
//! 1. [`gguf`] maps a model file and validates every header field before use.
//! 2. [`tokenizer`] builds a tokenizer from the file's metadata.
//! 3. [`quant`] holds the block formats and their SIMD dot products.
//! 4. [`kv`] owns the paged KV pool, its tenant partitions and page states.
//! 5. [`model`] runs the batched Llama forward pass over page tables.

pub mod gguf;
pub mod kv;
pub mod quant;
pub mod threads;
pub mod tokenizer;
