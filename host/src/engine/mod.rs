//! The control plane's view of the engine: sampling, chat templates and, for
//! now, a single-sequence generation driver used by `bulkhead generate` and the
//! benchmarks. The multi-tenant scheduler joins here with the serving issue.

pub mod admission;
pub mod build;
pub mod chat;
pub mod generate;
pub mod handoff;
pub mod json;
pub mod pattern;
pub mod placement;
mod prefix;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod schema;
pub mod service;
pub mod stats;
pub mod stop;
