//! The one place an engine stack is assembled: a model's weights → its KV pool
//! (the model's page geometry) → the CPU backend → the scheduler with its
//! tenants' partitions. The catalog (every served model), `bulkhead generate`,
//! the benchmarks and the tests all build through here, so they run the same
//! stack.

use super::scheduler::{BatchLimits, Scheduler, TenantChangeError, TenantLimits};
use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::kv::{KvType, Pool, PoolError, PoolOptions};
use bulkhead_kernels::model::{Model, ModelError};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::Arc;

/// What an engine is made of, besides the model and its tenants.
#[derive(Clone, Copy, Debug)]
pub struct EngineSpec {
    /// Pages in the KV pool (allocated once, here).
    pub pool_pages: u32,
    /// Token positions per page.
    pub page_tokens: u32,
    /// How the pool stores each KV value.
    pub kv_type: KvType,
    /// Compute threads.
    pub threads: usize,
    /// Most tokens in one step.
    pub step_tokens_max: u32,
    /// Most sequences in one step.
    pub step_seqs_max: u32,
    /// Pool test switches (poison, paranoid); off when serving.
    pub pool_options: PoolOptions,
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The pool's geometry (see the message).
    #[error("kv pool: {0}")]
    Pool(#[from] PoolError),
    /// A tenant's partition (see the message).
    #[error("tenant: {0}")]
    Tenant(#[from] TenantChangeError),
    /// The model file's tokenizer and weights disagree.
    #[error("model: {0}")]
    Model(#[from] ModelError),
}

/// The KV pool for `model`, with no partitions yet.
pub fn pool(model: &Model, spec: &EngineSpec) -> Result<Pool, PoolError> {
    let geometry = model
        .config
        .pool_geometry(spec.pool_pages, spec.page_tokens, spec.kv_type);
    Pool::new(geometry, &[], spec.pool_options)
}

/// The CPU backend for `model`.
pub fn backend(model: &Arc<Model>, spec: &EngineSpec) -> CpuBackend {
    CpuBackend::new(
        Arc::clone(model),
        CpuOptions {
            threads_count: spec.threads,
            step_tokens_max: spec.step_tokens_max as usize,
            step_seqs_max: spec.step_seqs_max as usize,
            isa: None,
        },
    )
}

/// The whole stack: pool, backend, and a scheduler with a partition per tenant.
pub fn scheduler(
    model: &Arc<Model>,
    tokenizer: &Arc<Tokenizer>,
    spec: &EngineSpec,
    tenants: Vec<TenantLimits>,
) -> Result<Scheduler<CpuBackend>, BuildError> {
    model.check_tokenizer(tokenizer)?;
    let pool = pool(model, spec)?;
    let limits = BatchLimits {
        step_tokens_max: spec.step_tokens_max,
        step_seqs_max: spec.step_seqs_max,
    };
    Ok(Scheduler::new(
        backend(model, spec),
        pool,
        Arc::clone(tokenizer),
        limits,
        tenants,
    )?)
}
