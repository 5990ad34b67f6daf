//! Bulkhead: a multi-tenant LLM inference host.
//!
//! The control plane lives here (engine driving, and later the API, tenancy and
//! policy); the data plane is the `bulkhead-kernels` crate.

pub mod bench;
pub mod config;
pub mod engine;
pub mod tenancy;
