//! Bulkhead: a multi-tenant LLM inference host.
//!
//! The control plane lives here (the HTTP API, tenancy, engine driving, and
//! later policy); the data plane is the `bulkhead-kernels` crate.

pub mod admin_cli;
pub mod api;
pub mod bench;
pub mod bench_http;
pub mod bench_plugins;
pub mod bench_scheduler;
pub mod capacity;
pub mod catalog;
pub mod clock;
pub mod config;
pub mod engine;
#[doc(hidden)]
pub mod fuzzing;
pub mod lane;
pub mod live;
pub mod policy;
pub mod quantize_cli;
pub mod server;
pub mod single;
pub mod store;
pub mod telemetry;
pub mod tenancy;
pub mod transfer;
