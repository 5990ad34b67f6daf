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
//! 5. [`model`] checks the weights against the architecture; [`backend`] runs
//!    the batched forward pass over page tables on [`threads`].
//! 6. [`testing`] generates tiny models for fast tests.
//!
//! The `fuzzing` module (hidden from the docs) holds the bodies of the fuzz
//! targets in `fuzz/`, so the corpus replay tests can call them too.

#![deny(missing_docs)]

pub mod backend;
#[doc(hidden)]
pub mod fuzzing;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod rng;
pub mod testing;
pub mod threads;
pub mod tokenizer;
